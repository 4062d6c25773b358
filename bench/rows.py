"""What a multi-token pass costs on the CPU: a forward of T tokens against a one-token decode step.

Speculative decoding assumes verifying gamma + 1 tokens costs about one decode step (Leviathan et al. 2023,
Sec. 3.4). On this project's CPU MKL's matrix product of 5-7 rows takes several times the one-row time, which caps
every speedup; oneDNN with weights reordered for its kernels (``--packed-weights``,
``Transformer.pack_weights``) does much better. This script times the embedded SmolLM2's forward over T tokens at a
fixed context (caches filled with random KV, no prefill; rolled back after each forward), for T in ``--rows``,
with plain and packed weights, interleaved over ``--reps`` (medians), and the logits' largest difference between
the two. JSON output.

    OMP_WAIT_POLICY=PASSIVE python bench/rows.py --context 8000 --rows 1 5 7 --reps 9 --threads 2 \
        --out bench/results/rows.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
from common import add_run_options  # noqa: E402  (bench/common.py, beside this script)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=8000)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 5, 7])
    add_run_options(p, "bench/results/rows.json", reps=9, sampling=False)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from triforce.caches import FullKVCache
    from triforce.loading import load_model
    from triforce.lab.synthetic import fill_random_kv

    plain = load_model(None).model
    packed = load_model(None).model
    if not packed.pack_weights():
        print("oneDNN linear kernels unavailable here: nothing to compare", file=sys.stderr)
        return 1
    n = args.context
    cache = FullKVCache(plain.cfg, n + max(args.rows) + 1)
    fill_random_kv(cache, n)
    gen = torch.Generator().manual_seed(0)
    times = {(kind, t): [] for kind in ("plain", "packed") for t in args.rows}
    diffs = {}
    for t in args.rows:
        ids = torch.randint(0, plain.cfg.vocab_size, (1, t), generator=gen)
        pos = torch.arange(n, n + t)
        a = plain(ids, pos, cache, num_logits=t)
        cache.rollback(n)
        b = packed(ids, pos, cache, num_logits=t)
        cache.rollback(n)
        diffs[t] = (a - b).abs().max().item()
    for rep in range(args.reps):
        for t in args.rows:
            ids = torch.randint(0, plain.cfg.vocab_size, (1, t), generator=gen)
            pos = torch.arange(n, n + t)
            order = [("plain", plain), ("packed", packed)]
            for kind, model in (order if rep % 2 == 0 else order[::-1]):
                t0 = time.perf_counter()
                model(ids, pos, cache, num_logits=t)
                times[(kind, t)].append(time.perf_counter() - t0)
                cache.rollback(n)
    rows = []
    for t in args.rows:
        row = {"tokens": t, "max_logit_difference": diffs[t]}
        for kind in ("plain", "packed"):
            row[f"{kind}_ms"] = round(1000 * statistics.median(times[(kind, t)]), 2)
        rows.append(row)
    base = {kind: next(r[f"{kind}_ms"] for r in rows if r["tokens"] == min(args.rows)) for kind in ("plain", "packed")}
    for r in rows:
        for kind in ("plain", "packed"):
            r[f"{kind}_vs_plain_decode"] = round(r[f"{kind}_ms"] / base["plain"], 2)
    out = {"model": "SmolLM2-135M-Instruct", "dtype": "float32", "context": n, "threads": args.threads,
           "reps": args.reps, "interleaved": True, "rows": rows, "command": "python " + " ".join(sys.argv)}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    print("| tokens per forward | MKL, (in, out) weights (ms) | oneDNN, packed weights (ms) | plain / packed | "
          "x plain 1-token decode (plain, packed) | max logit difference |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['tokens']} | {r['plain_ms']:.1f} | {r['packed_ms']:.1f} | {r['plain_ms'] / r['packed_ms']:.2f} | "
              f"{r['plain_vs_plain_decode']:.2f}, {r['packed_vs_plain_decode']:.2f} | {r['max_logit_difference']:.1e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
