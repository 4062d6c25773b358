"""The block-code products (csrc/blockcodes.c) over the embedded model's own codes, against an earlier build.

    python bench/kernels/blockcodes.py --threads 2 --reps 15 --rows 1 7 \
        --baseline-source <(git show HEAD~1:src/triforce/kernels/csrc/blockcodes.c) --out bench/results/blockcodes.json
    python bench/kernels/blockcodes.py --threads 2 --reps 21 --rows 1 2 4 7 --q8 --out bench/results/blockcodes_q8.json
    python bench/kernels/blockcodes.py --threads 2 --reps 21 --rows 1 2 4 7 --q8 --baseline-scales fp32 \
        --baseline-source <(git show 2a25216:src/triforce/kernels/csrc/blockcodes.c) --out
        bench/results/blockcodes_fp16.json

For every projection of SmolLM2-135M-Instruct (30 layers of Q4_1 codes, and its Q8_0 LM head: the weights a decode
step of the verifier reads, ``blockcodes.py``), one ``blockcode_linear`` call each, in order, every matrix distinct
(so a sweep reads them from memory as a decode step does), for each row count of ``--rows`` (1: a decode step or a
retrieval step; 7: a verification block of gamma2 = 6 drafts). With ``--baseline-source FILE`` the same sweep also
runs on the kernel built from that file (``baseline``), interleaved with ours (order alternated, medians), and the
outputs are compared bitwise (``baseline_bitwise_equal``). With ``--q8`` the same sweep also runs the integer dot
products over the same codes (``blockcode_linear_q8``: activations quantized to int8, the retrieval tier's
``--lower-weights codes``), interleaved too, with their error against the exact products (``q8_relative_error``: the
largest ||y_q8 - y|| / ||y|| over the matrices), and with ``--baseline-source`` on that build too
(``q8_speedup_over_baseline``, ``q8_baseline_bitwise_equal``). ``--baseline-scales fp32`` gives that build the blocks'
scales and minima as fp32 (the layout up to commit 2a25216; ours stores them as fp16). GB/s is code bytes (codes,
scales, minima) read per second. JSON on stdout (and to ``--out``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

import triforce  # noqa: F401  (first: sets OpenMP's spin before torch loads it, as the product does)

# isort: split
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/, for common.py
from common import add_run_options, emit_json, positive_int  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=positive_int, nargs="+", default=[1, 7])
    p.add_argument("--baseline-source", metavar="FILE", help="also time the kernel built from this blockcodes.c")
    p.add_argument("--q8", action="store_true", help="also time the integer dot products (int8 activations)")
    p.add_argument("--baseline-scales", choices=["fp16", "fp32"], default="fp16",
                   help="the dtype of the scales and minima the baseline build takes (default: fp16, ours)")
    add_run_options(p, None, reps=15, sampling=False)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from triforce.formats.loading import load_model
    from triforce.kernels import blockcodes
    from triforce.model.transformer import Linear

    if not blockcodes.blockcodes_status().startswith("on"):
        p.error(f"block-code kernel: {blockcodes.blockcodes_status()}")
    ours = blockcodes._blockcodes
    libs = {"ours": ours}
    if args.baseline_source:
        from triforce.formats.download import cache_dir

        src = Path(args.baseline_source)
        if not src.exists():
            p.error(f"--baseline-source: no such file {args.baseline_source!r}")
        copy = cache_dir() / "kernels" / "blockcodes_baseline.c"  # a process substitution can be read only once
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_text(src.read_text())
        base = blockcodes._Library(str(copy), ours.switch, ours.cpu_needs, ours.flags, ours.symbols)
        if base.load() is None:
            p.error(f"--baseline-source: the kernel from {src} is {base.status}")
        libs["baseline"] = base
    model = load_model(None).model
    codes = [m.codes for m in model.modules() if isinstance(m, Linear) and m.codes is not None]
    if not codes:
        p.error("the embedded model has no block codes here (TRIFORCE_BLOCK_CODES=0?)")
    nbytes = sum(c.nbytes for c in codes)
    base_codes = codes if args.baseline_scales == "fp16" else [
        dataclasses.replace(c, d=c.d.float(), m=None if c.m is None else c.m.float()) for c in codes]

    def sweep(lib, xs: dict, product=blockcodes.blockcode_linear, cs=codes) -> list[torch.Tensor]:
        blockcodes._blockcodes = lib  # what blockcode_linear calls
        try:
            return [product(xs[c.in_features], c) for c in cs]
        finally:
            blockcodes._blockcodes = ours

    variants = {"ours": lambda xs: sweep(ours, xs)}
    if "baseline" in libs:
        variants["baseline"] = lambda xs: sweep(libs["baseline"], xs, cs=base_codes)
    if args.q8:
        variants["q8"] = lambda xs: sweep(ours, xs, blockcodes.blockcode_linear_q8)
        if "baseline" in libs:
            variants["baseline_q8"] = lambda xs: sweep(libs["baseline"], xs, blockcodes.blockcode_linear_q8,
                                                       base_codes)

    gen = torch.Generator().manual_seed(0)
    results = []
    for rows in args.rows:
        xs = {n: torch.randn(rows, n, generator=gen) for n in {c.in_features for c in codes}}
        outs = {name: run(xs) for name, run in variants.items()}  # warm-up, and the outputs compared
        times: dict[str, list[float]] = {name: [] for name in variants}
        names = list(variants)
        for r in range(args.reps):
            for name in names[r % len(names):] + names[:r % len(names)]:
                t0 = time.perf_counter()
                variants[name](xs)
                times[name].append(time.perf_counter() - t0)
        row = {"rows": rows, "matrices": len(codes), "code_bytes": nbytes,
               "baseline_code_bytes": sum(c.nbytes for c in base_codes)}
        for name, ts in times.items():
            s = statistics.median(ts)
            row[f"{name}_ms"] = round(1000 * s, 3)
            row[f"{name}_gb_per_s"] = round(row["baseline_code_bytes" if "baseline" in name else "code_bytes"]
                                            / s / 1e9, 2)
        if "baseline" in libs:
            row["speedup_over_baseline"] = round(row["baseline_ms"] / row["ours_ms"], 3)
            row["baseline_bitwise_equal"] = all(torch.equal(a, b) for a, b in zip(outs["ours"], outs["baseline"]))
        if "q8" in variants:
            row["q8_speedup_over_ours"] = round(row["ours_ms"] / row["q8_ms"], 3)
            row["q8_relative_error"] = round(max(float((a - b).norm() / b.norm()) for a, b in zip(outs["q8"],
                                                                                              outs["ours"])), 5)
        if "baseline_q8" in variants:
            row["q8_speedup_over_baseline"] = round(row["baseline_q8_ms"] / row["q8_ms"], 3)
            row["q8_baseline_bitwise_equal"] = all(torch.equal(a, b) for a, b in zip(outs["q8"], outs["baseline_q8"]))
        results.append(row)
    out = {"model": "SmolLM2-135M-Instruct (embedded)", "threads": args.threads, "reps": args.reps,
           "interleaved": True, "kernel": ours.status, "baseline": args.baseline_source,
           "baseline_scales": args.baseline_scales, "results": results}
    emit_json(out, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
