"""Our CPU attention kernel (csrc/attention.c) against PyTorch's SDPA: attention alone, and whole verifier forwards.

    python bench/kernels/attention_kernel.py --threads 2 --contexts 1000 4000 8000 \
        [--out bench/results/attention_kernel.json]

Three measurements, in one process, repetitions interleaved (kernel and SDPA alternate, order rotated), medians:

* ``stream_gb_per_s``: the memory's read bandwidth (``common.stream_probe``: a sum over 640 MB), and for reference
  ``gemv_gb_per_s``, a large fp32 matrix-vector product's (1 x 576 by 576 x 9216, 30 distinct matrices, 637 MB, the
  shape of a SmolLM2 decode step's biggest product; the floor's bandwidth before 2026-12-05, 1.9x below the memory's
  on this project's EPYC);
* ``peak_gflop_per_s``: the FLOP rate of a large fp32 matrix product (1024^3, oneDNN over prepacked weights:
  ``common.gemm_probe``), the compute ceiling; a verification block's attention does ``4 * g * T * hs`` FLOP per key
  (``attention[].gflop``). An attention's ``floor_ms`` is the larger of reading its keys and values once at
  ``stream_gb_per_s`` (``memory_ms``) and its FLOPs at ``peak_gflop_per_s`` (``compute_ms``).
* ``attention``: 30 layers of GQA attention over random fp32 keys and values, SmolLM2's shape (9 query heads over
  3 KV heads, head_dim 64) and Qwen2.5-1.5B's (12 over 2, 128; 28 layers), for each ``--tokens`` count of query
  tokens (1: a decode step; 7: a verification block of gamma2 = 6 drafts; default 1 and 7), with SDPA as
  ``sdpa.gqa_attention`` calls it and with the kernel.
* ``forward``: the embedded SmolLM2 (fp32, oneDNN-packed weights) over a FullKVCache of random KV: 1 token (an
  autoregressive decode step) and 7 tokens (``full_pass``), the cache attending with SDPA or with the kernel
  (``FullKVCache.kernel_max_block``).

With ``--baseline-source FILE`` (an earlier ``attention.c``, e.g. ``git show
HEAD~1:src/triforce/kernels/csrc/attention.c``) the attention rows also time the kernel built from that file
(``baseline``), interleaved with the others, so that a change to the kernel is measured against the code before it in
one run, and check that both give bitwise the same output (``baseline_bitwise_equal``).

JSON on stdout (and to ``--out``).
"""

from __future__ import annotations

import argparse
import os
import sys

import triforce  # noqa: F401  (first: sets OpenMP's spin before torch loads it, as the product does)

# isort: split
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/, for common.py
from common import _interleaved, emit_json, floor_bandwidth, gemv_probe, peak_flops, positive_int  # noqa: E402


def _with_library(lib, fn):
    """Run ``fn`` with ``kernels.gqa_attention_kernel`` calling the attention library ``lib`` (a kernels._Library)."""
    from triforce.kernels import cpu as kernels

    current, kernels._attention = kernels._attention, lib
    try:
        return fn()
    finally:
        kernels._attention = current


def attention_rows(shape: tuple[int, int, int, int], context: int, t: int, reps: int, bw: float, peak: float,
                   baseline=None) -> dict:
    from triforce.kernels.cpu import gqa_attention_kernel
    from triforce.kernels.sdpa import gqa_attention
    from triforce.kv.caches import _causal_offset_mask

    layers, nh, nkv, hs = shape
    k = torch.randn(layers, 1, nkv, context + 8, hs)
    v = torch.randn(layers, 1, nkv, context + 8, hs)
    q = torch.randn(1, nh, t, hs)
    n = context + t
    mask = None if t == 1 else _causal_offset_mask(context, t, n, q.device)
    fns = {"sdpa": lambda: [gqa_attention(q, k[i, :, :, :n], v[i, :, :, :n], mask) for i in range(layers)],
           "kernel": lambda: [gqa_attention_kernel(q, k[i], v[i], n) for i in range(layers)]}
    extra = {}
    if baseline is not None:
        fns["baseline"] = lambda: _with_library(baseline, fns["kernel"])
        extra["baseline_bitwise_equal"] = all(torch.equal(a, b) for a, b in zip(fns["kernel"](), fns["baseline"]()))
    s = _interleaved(fns, reps)
    kv = 2 * layers * nkv * n * hs * 4
    flop = 4 * nh * t * hs * n * layers
    return {"layers": layers, "heads": nh, "kv_heads": nkv, "head_dim": hs, "context": context, "tokens": t,
            "kv_mb": round(kv / 1e6, 1), "gflop": round(flop / 1e9, 3), "memory_ms": round(1000 * kv / bw, 2),
            "compute_ms": round(1000 * flop / peak, 2), "floor_ms": round(1000 * max(kv / bw, flop / peak), 2),
            "kernel_over_floor": round(s["kernel"] / max(kv / bw, flop / peak), 2),
            **{f"{m}_ms": round(1000 * s[m], 2) for m in fns},
            **{f"{m}_gb_per_s": round(kv / s[m] / 1e9, 2) for m in fns},
            "speedup": round(s["sdpa"] / s["kernel"], 3),
            **({"speedup_over_baseline": round(s["baseline"] / s["kernel"], 3)} if baseline is not None else {}),
            **extra}


def forward_rows(model, context: int, reps: int) -> list[dict]:
    from triforce.kv.caches import FullKVCache
    from triforce.lab.synthetic import fill_random_kv

    cache = FullKVCache(model.cfg, capacity=context + 8)
    fill_random_kv(cache, context)
    rows = []
    for t in (1, 7):
        ids = torch.randint(0, model.cfg.vocab_size, (1, t))
        pos = torch.arange(context, context + t)

        def step(max_block: int) -> None:
            cache.kernel_max_block = max_block
            model(ids, pos, cache)
            cache.rollback(context)

        s = _interleaved({"sdpa": lambda: step(0), "kernel": lambda: step(8)}, reps)
        rows.append({"model": "SmolLM2-135M-Instruct", "context": context, "tokens": t,
                     **{f"{m}_ms": round(1000 * s[m], 2) for m in s}, "speedup": round(s["sdpa"] / s["kernel"], 3)})
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--contexts", type=int, nargs="+", default=[1000, 4000, 8000])
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--tokens", type=positive_int, nargs="+", default=[1, 7], help="query tokens per attention")
    p.add_argument("--no-forward", action="store_true", help="skip the whole-model forwards (no model needed)")
    p.add_argument("--baseline-source", metavar="FILE", help="also time the kernel built from this attention.c")
    p.add_argument("--out")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from pathlib import Path

    from triforce.kernels import cpu as kernels

    out = {"threads": args.threads, "kernel": kernels.status(), "reps": args.reps}
    baseline = None
    if args.baseline_source:
        src = Path(args.baseline_source).resolve()
        if not src.is_file():
            p.error(f"--baseline-source: no such file {args.baseline_source!r}")
        baseline = kernels._Library(str(src), "TRIFORCE_ATTENTION_KERNEL", ("avx2", "fma"), kernels._attention_flags,
                                    kernels._attention.symbols)
        if baseline.load() is None:
            p.error(f"--baseline-source: the kernel from {src} is {baseline.status}")
        out["baseline"] = {"source": str(src), "status": baseline.status}
    bw, peak = floor_bandwidth(args.reps), peak_flops(args.reps)
    gemv, gemv_bytes = gemv_probe()
    out["stream_gb_per_s"] = round(bw / 1e9, 2)
    out["gemv_gb_per_s"] = round(gemv_bytes / _interleaved({"gemv": gemv}, args.reps)["gemv"] / 1e9, 2)
    out["peak_gflop_per_s"] = round(peak / 1e9, 1)
    out["attention"] = [attention_rows(shape, c, t, args.reps, bw, peak, baseline)
                        for shape in ((30, 9, 3, 64), (28, 12, 2, 128)) for c in args.contexts for t in args.tokens]
    if not args.no_forward:
        from triforce.formats.loading import load_model

        model = load_model(None).model
        model.pack_weights()
        out["forward"] = [r for c in args.contexts for r in forward_rows(model, c, args.reps)]
    emit_json(out, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
