"""Attention recovery of the retrieval cache's chunk selection, per chunk score (TriForce Sec. 3.1, Fig. 2).

Recovery = the share of a query's attention mass over the earlier positions that falls on the keys the retrieval
cache keeps (the query's attention to itself, present in every cache, is left out of both). The query is the last
prompt token's (post-RoPE, as the model's attention receives it); the keys are every earlier position.
For each layer, each query head, each budget and each chunk score (``mean``: the paper's q . mean key; ``max``:
the best key of the chunk; ``bound``: Quest's per-channel upper bound) it selects the chunks exactly as the
retrieval cache does (``RetrievalCache.build``) and sums the head's softmax over the kept positions. ``oracle``
keeps the best individual tokens. Means over heads, layers and books; JSON output with per-layer values.

    python bench/recovery.py --books pg1342.txt pg84.txt pg2701.txt --prompt-tokens 7500 \
        --budgets 256 512 1024 2048 --out bench/results/recovery.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

BOOKS = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "books")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--books", nargs="+", default=["pg1342.txt", "pg84.txt", "pg2701.txt"])
    p.add_argument("--prompt-tokens", type=int, default=7500)
    p.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024, 2048])
    p.add_argument("--chunk-size", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="bench/results/recovery.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from triforce import load_model
    from triforce.caches import CHUNK_SCORES, FullKVCache, RetrievalCache
    from triforce.prompts import strip_gutenberg

    lm = load_model(None)
    model, cfg = lm.model, lm.model.cfg
    g = cfg.num_kv_groups
    results: dict = {}
    for book in args.books:
        path = os.path.join(BOOKS, book)
        if not os.path.isfile(path):
            print(f"skipping {book}: not found", file=sys.stderr)
            continue
        ids = lm.tokenizer(strip_gutenberg(open(path, encoding="utf-8").read()))["input_ids"][:args.prompt_tokens]
        n = len(ids) - 1  # keys: positions [0, n); query: position n (the last prompt token)
        full = FullKVCache(cfg, len(ids), record_queries=True)
        for i in range(0, len(ids), 512):
            chunk = ids[i:i + 512]
            model(torch.tensor([chunk]), torch.arange(i, i + len(chunk)), full, num_logits=1)
        query = full.query_at(n)  # (L, 1, nh, hs)
        keys = full.k[:, 0, :, :n].float()  # (L, nkv, n, hs)
        q = query[:, 0].float().reshape(cfg.num_hidden_layers, cfg.num_key_value_heads, g, -1)  # (L, nkv, g, hs)
        logits = torch.einsum("lkgd,lknd->lkgn", q, keys) / math.sqrt(cfg.head_dim)
        probs = torch.softmax(logits, -1)  # (L, nkv, g, n): attention over the prompt's earlier positions

        full.rollback(n)
        for budget in args.budgets:
            for score in CHUNK_SCORES + ("oracle",):
                if score == "oracle":
                    top = probs.topk(min(budget, n), dim=-1).values.sum(-1)  # best tokens per query head
                    rec = top
                else:
                    cache = RetrievalCache(cfg, full, budget, args.chunk_size, score)
                    cache.build(n, query)
                    sel = cache.selected[:, 0, :, :cache.n_selected]  # (L, nkv, m)
                    kept = torch.zeros(cfg.num_hidden_layers, cfg.num_key_value_heads, n)
                    kept.scatter_(-1, sel, 1.0)
                    rec = (probs * kept[:, :, None]).sum(-1)  # (L, nkv, g)
                per_layer = rec.mean(dim=(1, 2)).tolist()
                results.setdefault(str(budget), {}).setdefault(score, {})[book] = per_layer
        print(f"{book}: done", file=sys.stderr, flush=True)
    summary = {b: {s: round(sum(sum(v) / len(v) for v in books.values()) / len(books), 4) for s, books in d.items()}
               for b, d in results.items()}
    layers = {b: {s: [round(sum(v[i] for v in books.values()) / len(books), 4) for i in range(cfg.num_hidden_layers)]
                  for s, books in d.items()} for b, d in results.items()}
    out = {"command": "python " + " ".join(sys.argv), "prompt_tokens": args.prompt_tokens,
           "chunk_size": args.chunk_size, "books": args.books, "mean_recovery": summary, "per_layer": layers}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    print("| budget | " + " | ".join(list(CHUNK_SCORES) + ["oracle"]) + " |")
    print("|---|" + "---|" * (len(CHUNK_SCORES) + 1))
    for b, row in summary.items():
        print(f"| {b} | " + " | ".join(f"{row[s]:.3f}" for s in list(CHUNK_SCORES) + ["oracle"]) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
