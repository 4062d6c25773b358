"""What verification costs in attention: SmolLM2-shaped GQA attention over an 8K fp32 KV cache, 1 query row vs T rows.

    python bench/kernels/attention_rows.py --threads 2 --context 8000 --rows 1 7 \
        [--out bench/results/attention_rows.json]

A decode step attends 1 query per head over the cache; a verification of gamma2 = 6 drafts attends 7. With grouped
queries (SmolLM2: 9 query heads over 3 KV heads) the g * T query rows of a KV head share its keys, so a 7-token pass
multiplies 21 rows by each KV head's keys: 10.5 flop per byte of fp32 keys, past this CPU's memory/compute balance,
so the pass is compute-bound where the decode step is memory-bound. Times all 30 layers' attention (random keys and
values, positions 0..context, causal within the block) with PyTorch's SDPA as ``sdpa.gqa_attention`` calls it,
medians of interleaved repetitions; reports ms and the bytes/s of reading K and V once.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import triforce  # noqa: F401  (first: sets OpenMP's spin before torch loads it, as the product does)

# isort: split
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/, for common.py
from common import emit_json, positive_int  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=positive_int, default=8000)
    p.add_argument("--rows", type=positive_int, nargs="+", default=[1, 7])
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--out")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from triforce.kernels.sdpa import gqa_attention

    layers, nkv, nh, hs, s = 30, 3, 9, 64, args.context  # SmolLM2-135M
    t_max = max(args.rows)
    k = torch.randn(layers, 1, nkv, s + t_max, hs)
    v = torch.randn(layers, 1, nkv, s + t_max, hs)
    queries = {t: torch.randn(1, nh, t, hs) for t in args.rows}
    masks = {t: None if t == 1 else torch.arange(s + t)[None, :] <= torch.arange(s, s + t)[:, None] for t in args.rows}
    times: dict[int, list[float]] = {t: [] for t in args.rows}
    for rep in range(args.reps + 1):
        for t in (args.rows if rep % 2 else args.rows[::-1]):
            t0 = time.perf_counter()
            for layer in range(layers):
                gqa_attention(queries[t], k[layer, :, :, :s + t], v[layer, :, :, :s + t], masks[t])
            if rep:  # the first round warms up
                times[t].append(time.perf_counter() - t0)
    kv_bytes = 2 * layers * nkv * s * hs * 4
    rows = []
    for t in args.rows:
        ms = 1000 * statistics.median(times[t])
        rows.append({"rows": t, "query_rows_per_kv_head": nh // nkv * t, "ms": round(ms, 2),
                     "kv_read_gb_per_s": round(kv_bytes / ms / 1e6, 2),
                     "flop_per_kv_byte": round(2 * (nh // nkv) * t / 4, 2)})
    base = rows[0]["ms"]
    for r in rows:
        r["vs_first"] = round(r["ms"] / base, 2)
    out = {"context": s, "threads": args.threads, "shape": "SmolLM2-135M (30 layers, 9/3 heads, 64)", "fp32": True,
           "rows": rows}
    emit_json(out, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
