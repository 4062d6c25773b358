"""What the portable builds cost: each kernel's plain C build (no ISA flags, what a CPU without AVX2 or aarch64 runs;
``TRIFORCE_KERNEL_ISA=portable``) against this CPU's own build, on SmolLM2-135M's shapes.

    python bench/kernels/portable.py --threads 1 --reps 9 --out bench/results/portable.json

Random weights of SmolLM2's layer shapes (qkv 576->960, gate/up 576->3072, down 1536->576; in the block codes of
Q4_1, as the embedded model stores them) and a random fp32 cache of its attention shape (9 heads over 3 KV heads of
64) at ``--context`` keys: ``kernels.f32_linear`` and ``blockcodes.blockcode_linear`` for each ``--rows``, and
``kernels.gqa_attention_kernel`` for a decode step (1 token) and a 7-token verification block, on this CPU's builds
and on the portable ones swapped in (``kernels.linear_build``, ``blockcodes.blockcodes_build``,
``kernels.attention_build``), interleaved, medians; ``statuses`` names the builds. The
portable build's figures on an AVX2 or AVX-512 machine are its SSE2 code's, an upper bound on its cost against a
native build there; on a CPU without AVX2 the native build is the portable one.
"""

from __future__ import annotations

import argparse
import os
import sys

import triforce  # noqa: F401  (first: sets OpenMP's spin before torch loads it, as the product does)

# isort: split
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/, for common.py
from common import _interleaved, add_run_options, emit_json, positive_int  # noqa: E402

#: SmolLM2-135M's projections, (in, out)
SHAPES = ((576, 960), (576, 3072), (1536, 576))


def _q4_1(w_t: torch.Tensor) -> torch.Tensor:
    """(in, out) weights rounded to GGUF's Q4_1 (fp16 scale and minimum per 32 inputs), as ``w = fl(fl(d q) + m)``."""
    g = w_t.T.reshape(w_t.shape[1], -1, 32)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    d, m = ((hi - lo) / 15).half().float(), lo.half().float()
    q = torch.where(d > 0, torch.round((g - m) / torch.where(d > 0, d, torch.ones_like(d))), torch.zeros_like(g))
    return (d * q.clamp(0, 15) + m).reshape(w_t.shape[1], -1).T.contiguous()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=positive_int, nargs="+", default=[1, 7])
    p.add_argument("--context", type=positive_int, default=8000)
    add_run_options(p, "bench/results/portable.json", reps=9, threads=1, sampling=False)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from triforce.kernels import blockcodes
    from triforce.kernels import cpu as kernels
    from triforce.kernels.codes import find_block_codes

    native = (kernels._linear, blockcodes._blockcodes, kernels._attention)  # this CPU's builds, loaded
    for lib in native:
        if lib.load() is None:
            p.error(f"csrc/{lib.source} is {lib.status}")
    builds = {"native": native,
              "portable": (kernels.linear_build("portable"), blockcodes.blockcodes_build("portable"),
                           kernels.attention_build("portable"))}
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n_in, n_out, generator=gen) * 0.05 for n_in, n_out in SHAPES]
    coded = [_q4_1(w) for w in weights]
    codes = [find_block_codes(w) for w in coded]
    k = torch.randn(1, 3, args.context, 64, generator=gen)
    v = torch.randn(1, 3, args.context, 64, generator=gen)
    cases = {}
    for rows in args.rows:
        xs = [torch.randn(rows, n_in, generator=gen) for n_in, _ in SHAPES]
        cases[f"f32 products, {rows} rows"] = lambda xs=xs: [kernels.f32_linear(x, w) for x, w in zip(xs, weights)]
        cases[f"Q4_1 block-code products, {rows} rows"] = (
            lambda xs=xs: [blockcodes.blockcode_linear(x, c) for x, c in zip(xs, codes)])
    for t in (1, 7):
        q = torch.randn(1, 9, t, 64, generator=gen)
        cases[f"attention, {t} token{'s' if t > 1 else ''} at {args.context}"] = (
            lambda q=q: kernels.gqa_attention_kernel(q, k, v, args.context))
    results = {}
    for case, fn in cases.items():
        fns = {}
        for name, (linear, codes_lib, attention) in builds.items():
            def run(fn=fn, libs=(linear, codes_lib, attention)):
                kernels._linear, blockcodes._blockcodes, kernels._attention = libs
                return fn()
            fns[name] = run
        times = _interleaved(fns, args.reps)
        results[case] = {**{f"ms_{name}": round(s * 1e3, 4) for name, s in times.items()},
                         "portable_over_native": round(times["portable"] / times["native"], 3)}
    emit_json({"threads": args.threads, "reps": args.reps, "results": results,
               "statuses": {name: [lib.status for lib in libs] for name, libs in builds.items()}}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
