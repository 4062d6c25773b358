"""Beyond the paper, measured: n-gram bottom tier, adaptive speculation, chunk scores, retrieval refresh.

On the embedded SmolLM2-135M-Instruct (no draft model shares its tokenizer here, so the bottom tier is the
n-gram drafter) and book prompts, two kinds of prompt:

* ``continue``: the first N tokens of a book, continued;
* ``chat``: the first N tokens of a book inside the chat template, followed by a request to summarize it
  (copying from the prompt is common there).

Every configuration runs on the same prompt in one process, interleaved over ``--reps`` repetitions (median
reported), with the same sampling, dtype and threads. JSON output; ``--markdown`` prints the table.

    python bench/beyond.py --books pg1342.txt pg84.txt --prompt-tokens 4000 --new-tokens 128 --threads 2 \
        --out bench/results/beyond.json --markdown
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

BOOKS = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "books")

# name -> SpeculationConfig keyword arguments
CONFIGS = {
    "autoregressive": dict(mode="autoregressive"),
    "retrieval": dict(mode="retrieval", budget=1024),
    "retrieval-max": dict(mode="retrieval", budget=1024, chunk_score="max"),
    "retrieval-bound": dict(mode="retrieval", budget=1024, chunk_score="bound"),
    "ngram": dict(tiers="ngram:6"),
    "ngram-adaptive": dict(tiers="ngram:6", adaptive_gamma=True),
    "ngram>retrieval": dict(tiers="ngram:6,retrieval:6", budget=1024),
    "ngram>retrieval-adaptive": dict(tiers="ngram:6,retrieval:6", budget=1024, adaptive_gamma=True),
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--books", nargs="+", default=["pg1342.txt", "pg84.txt"])
    p.add_argument("--prompt-tokens", type=int, default=4000)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--kinds", nargs="+", default=["continue", "chat"], choices=["continue", "chat"])
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="bench/results/beyond.json")
    p.add_argument("--markdown", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from triforce import SamplingParams, SpeculationConfig, TriForce
    from triforce.prompts import strip_gutenberg

    tf = TriForce.load()
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p)
    records = []
    for book in args.books:
        path = os.path.join(BOOKS, book)
        if not os.path.isfile(path):
            print(f"skipping {book}: not found", file=sys.stderr)
            continue
        text = strip_gutenberg(open(path, encoding="utf-8").read())
        for kind in args.kinds:
            if kind == "continue":
                ids = tf.encode(text, max_prompt_tokens=args.prompt_tokens)
            else:
                doc = tf.tokenizer.decode(tf.tokenizer(text)["input_ids"][:args.prompt_tokens])
                ids = tf.encode(doc + "\n\nSummarize the text above, quoting its key sentences.", chat=True)
            for rep in range(args.reps):
                for name in args.configs:
                    spec = SpeculationConfig(**CONFIGS[name])
                    t0 = time.perf_counter()
                    result = tf.generate(ids, max_new_tokens=args.new_tokens, sampling=sampling, spec=spec, seed=rep)
                    s = result.stats
                    rec = {"book": book, "kind": kind, "config": name, "rep": rep, "prompt_tokens": len(ids),
                           "generated": s.generated_tokens, "tokens_per_second": s.decode_tokens_per_second,
                           "tbt_ms": s.mean_time_between_tokens_ms, "wall_s": round(time.perf_counter() - t0, 3),
                           "tiers": s.tiers}
                    records.append(rec)
                    acc = {t: v.get("acceptance_rate") for t, v in s.tiers.items() if v.get("verifications")}
                    print(f"{book} {kind} {name}: {s.decode_tokens_per_second:.2f} tok/s, acceptance {acc}",
                          file=sys.stderr, flush=True)
    summary = []
    for kind in args.kinds:
        ar = [r["tokens_per_second"] for r in records if r["kind"] == kind and r["config"] == "autoregressive"]
        base = statistics.median(ar) if ar else None
        for name in args.configs:
            rs = [r for r in records if r["kind"] == kind and r["config"] == name]
            if not rs:
                continue
            tps = statistics.median(r["tokens_per_second"] for r in rs)
            row = {"kind": kind, "config": name, "tokens_per_second": round(tps, 3),
                   "speedup_vs_autoregressive": round(tps / base, 3) if base else None}
            for tier in ("retrieval", "target"):
                vals = [r["tiers"].get(tier, {}).get("acceptance_rate") for r in rs]
                vals = [v for v in vals if v is not None]
                if vals:
                    row[f"{tier}_acceptance"] = round(statistics.mean(vals), 3)
                toks = [r["tiers"].get(tier, {}).get("mean_tokens_per_verification") for r in rs]
                toks = [v for v in toks if v is not None]
                if toks:
                    row[f"{tier}_tokens_per_verification"] = round(statistics.mean(toks), 3)
            row["target_forwards"] = statistics.mean(r["tiers"]["target"]["forward_passes"] for r in rs)
            summary.append(row)
    out = {"command": "python " + " ".join(sys.argv), "threads": args.threads, "temperature": args.temperature,
           "top_p": args.top_p, "records": records, "summary": summary}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    if args.markdown:
        print("| prompt | configuration | tokens/s | vs autoregressive | target acceptance | tokens/verification "
              "| retrieval acceptance | target forwards |")
        print("|---|---|---|---|---|---|---|---|")
        for r in summary:
            print(f"| {r['kind']} | {r['config']} | {r['tokens_per_second']:.2f} | {r['speedup_vs_autoregressive']} "
                  f"| {r.get('target_acceptance', '-')} | {r.get('target_tokens_per_verification', '-')} "
                  f"| {r.get('retrieval_acceptance', '-')} | {r['target_forwards']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
