"""Products of a few rows over a whole model's weights: our kernels (AVX-512, AVX2 or portable) against PyTorch's ops.

    python bench/kernels/qlinear.py --threads 2 --reps 9 --out bench/results/qlinear.json
    python bench/kernels/qlinear.py --threads 2 --reps 9 --build AVX2   # the AVX2 build, on an AVX-512 machine too
    python bench/kernels/qlinear.py --threads 2 --reps 9 --build portable   # the plain C build (no ISA flags)

For SmolLM2-135M's projection shapes (30 layers of qkv 576->960, o 576->576, gate/up 576->3072, down 1536->576,
and the 576->49,152 LM head: 135 MB of int8 weights; ``--shapes qwen2.5-1.5b``: Qwen2.5-1.5B's 28 layers and
LM head, 1.78 GB), every matrix distinct, so a sweep reads them from memory as a
decode step does (not from cache): ``kernels.int8_linear`` (``csrc/qlinear.c``), ``aten._weight_int8pack_mm``
(bf16 activations; what ``quant.Int8Linear`` ran before the kernel), and the fp32 products of the same shapes: MKL's
(``x @ W``, W (in, out): the verifier's decode step), oneDNN's with packed weights (what the verifier's multi-token
passes ran before our kernel) and ours (``kernels.f32_linear``, W (in, out), what ``model.Linear`` runs for 2 to 64
rows), for 1, 2, 4, 5, 7 and 8 activation rows by default (a decode step, batched decode steps, a retrieval tier's
5-token block, a 7-token verification; ``--rows 14 28 56``: batches of verifications). Interleaved repetitions, medians;
GB/s is weight bytes read per second. Random weights: timing only (``tests/test_kernels.py`` checks the values).
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
from common import add_run_options, emit_json, positive_int  # noqa: E402

SHAPES = {  # (out, in) of every projection and the LM head
    "smollm2": [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)],  # SmolLM2-135M
    "qwen2.5-1.5b": [(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960)] * 28 + [(151936, 1536)],
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_options(p, None, reps=9, sampling=False, out_help="write the JSON there")
    p.add_argument("--rows", type=positive_int, nargs="+", default=[1, 2, 4, 5, 7, 8],
                   help="activation row counts to time (1 to kernels.LINEAR_MAX_ROWS)")
    p.add_argument("--shapes", choices=sorted(SHAPES), default="smollm2",
                   help="whose matrices (qwen2.5-1.5b: 7.1 GB of fp32 weights, 16 GB with the int8 and packed copies)")
    p.add_argument("--no-onednn", action="store_true",
                   help="skip oneDNN's packed product (its copy of the weights: Qwen's shapes fit in 24 GiB "
                        "without it)")
    p.add_argument("--build", choices=["native", "AVX-512", "AVX2", "portable"], default="native",
                   help="which build of csrc/qlinear.c to time (native: this CPU's best, what the product runs)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from triforce.kernels import cpu as kernels

    if args.build != "native":
        kernels._linear = kernels.linear_build(args.build)

    if not all(1 <= r <= kernels.LINEAR_MAX_ROWS for r in args.rows):
        p.error(f"--rows must lie in 1..{kernels.LINEAR_MAX_ROWS}, got {args.rows}")
    status = kernels.linear_status()
    if not status.startswith("on"):  # the kernels return None at once: timing them would report nonsense
        p.error(f"the linear kernels are {status}; this benchmark times them")
    gen = torch.Generator().manual_seed(0)
    qs = [torch.randint(-127, 128, s, dtype=torch.int8, generator=gen) for s in SHAPES[args.shapes]]
    scales = [torch.rand(s[0], generator=gen) * 0.01 for s in SHAPES[args.shapes]]
    scales_bf16 = [s.to(torch.bfloat16) for s in scales]
    weights = [torch.randn(s[1], s[0], generator=gen) for s in SHAPES[args.shapes]]  # fp32, (in, out)
    packed = [] if args.no_onednn else [torch.ops.mkldnn._reorder_linear_weight(w.T.contiguous(), None)
                                        for w in weights]  # oneDNN's
    int8_bytes = sum(q.numel() for q in qs)
    rows_out = []
    for rows in args.rows:
        x = {n: torch.randn(rows, n, generator=gen) for n in {s[1] for s in SHAPES[args.shapes]}}
        xb = {n: v.to(torch.bfloat16) for n, v in x.items()}
        kinds = {
            "ours_int8": (lambda: [kernels.int8_linear(x[q.shape[1]], q, s) for q, s in zip(qs, scales)], int8_bytes),
            "aten_int8": (lambda: [torch.ops.aten._weight_int8pack_mm(xb[q.shape[1]], q, s)
                                   for q, s in zip(qs, scales_bf16)], int8_bytes),
            "fp32_mkl": (lambda: [x[w.shape[0]] @ w for w in weights], 4 * int8_bytes),
            "fp32_onednn": (lambda: [torch.ops.mkldnn._linear_pointwise(x[w.shape[0]], p, None, "none", [], "")
                                     for w, p in zip(weights, packed)], 4 * int8_bytes),
            "fp32_ours": (lambda: [kernels.f32_linear(x[w.shape[0]], w) for w in weights], 4 * int8_bytes),
        }
        if args.no_onednn:
            del kinds["fp32_onednn"]
        if rows > kernels.INT8_LINEAR_MAX_ROWS:  # the kernel declines (returns None at once): aten's op runs instead
            del kinds["ours_int8"]
        times = {k: [] for k in kinds}
        for fn, _ in kinds.values():  # warm-up
            fn()
        for rep in range(args.reps):
            names = list(kinds)
            names = names[rep % len(names):] + names[:rep % len(names)]
            for k in names:
                t0 = time.perf_counter()
                kinds[k][0]()
                times[k].append(time.perf_counter() - t0)
        row = {"rows": rows}
        for k, (_, nbytes) in kinds.items():
            med = statistics.median(times[k])
            row[k] = {"ms": round(1e3 * med, 3), "GB_per_s": round(nbytes / med / 1e9, 2),
                      "min_ms": round(1e3 * min(times[k]), 3), "max_ms": round(1e3 * max(times[k]), 3)}
        if "ours_int8" in row:
            row["int8_ours_speedup_over_aten"] = round(row["aten_int8"]["ms"] / row["ours_int8"]["ms"], 3)
        if not args.no_onednn:
            row["fp32_ours_speedup_over_onednn"] = round(row["fp32_onednn"]["ms"] / row["fp32_ours"]["ms"], 3)
        row["fp32_ours_speedup_over_mkl"] = round(row["fp32_mkl"]["ms"] / row["fp32_ours"]["ms"], 3)
        rows_out.append(row)
    out = {"threads": args.threads, "reps": args.reps, "int8_kernel": status,
           "weights_MB_int8": round(int8_bytes / 1e6, 1), "shapes": args.shapes,
           "results": rows_out}
    emit_json(out, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
