"""Attention recovery of the retrieval cache's chunk selection, per chunk score (TriForce Sec. 3.1, Fig. 2).

A thin wrapper over :mod:`triforce.lab.analyze` (``triforce analyze --analyses recovery`` computes the same, with a
PNG):
recovery = the share of the last prompt token's attention mass over the earlier positions that falls on the keys
the retrieval cache keeps (its own key, present in every cache, left out of both), per layer, budget and chunk
score (``mean``: the paper's q . mean key; ``max``: the best key of the chunk; ``bound``: Quest's per-channel upper
bound; ``oracle``: the best individual tokens of each query head). Selection = ``RetrievalCache.build`` itself.
Means over heads, layers and books; JSON output with per-layer values.

    python bench/acceptance/recovery.py --books pg1342.txt pg84.txt pg2701.txt --prompt-tokens 7500 \
        --budgets 256 512 1024 2048 --out bench/results/recovery.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

BOOKS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data", "books")


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
    from triforce.lab.analyze import prefill_recorded, recovery_at_query, summarize_recovery
    from triforce.lab.analyze.summaries import recovery_table
    from triforce.lab.books import book_prompt, resolve_book

    lm = load_model(None)
    per_book = {}
    for book in args.books:
        try:
            path = resolve_book(book, BOOKS)
        except FileNotFoundError as e:
            print(f"skipping {book}: {e}", file=sys.stderr)
            continue
        ids = book_prompt(lm.tokenizer, path, args.prompt_tokens)
        full, query, _ = prefill_recorded(lm.model, ids)
        per_book[book] = recovery_at_query(lm.model, full, query, len(ids) - 1, args.budgets, args.chunk_size)
        print(f"{book}: done", file=sys.stderr, flush=True)
    if not per_book:
        print("no book found; nothing measured", file=sys.stderr)
        return 0
    summary = summarize_recovery(per_book)
    out = {"command": "python " + " ".join(sys.argv), "prompt_tokens": args.prompt_tokens,
           "chunk_size": args.chunk_size, "books": list(per_book), **summary}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    print(recovery_table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
