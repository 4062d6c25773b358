"""What a multi-token pass costs on the CPU: a forward of T tokens against a one-token decode step.

Speculative decoding assumes verifying gamma + 1 tokens costs about one decode step (Leviathan et al. 2023,
Sec. 3.4). This script times the embedded SmolLM2's forward over T tokens at a fixed context (caches filled with
random KV, no prefill; rolled back after each forward), for T in ``--rows``, with the ways the projections can
run: ``ours`` (the default, the verifier's exactness rule, ``triforce/exact.py``: ``kernels.f32_linear`` for every
row count of a decode step or block), ``ours_one_row`` (the rule off: our kernel for 2-64 rows and one row, whatever
the build, to A/B that choice in one run), ``onednn`` (weights
prepacked for oneDNN, ``--packed-weights on`` before our kernel) and ``mkl`` (MKL's product over the (in, out)
weights for every row count), interleaved over ``--reps`` (medians), each against the one-token decode step of
``mkl`` (what autoregressive decoding runs; ``ours`` runs the same code for one row), and the logits' largest
difference from ``mkl``. The attention kernel is the same in all of them. JSON output; a Markdown table on stdout.

    python bench/kernels/rows.py --context 8000 --rows 1 4 7 512 --reps 9 --threads 2 --out bench/results/rows.json
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=positive_int, default=8000)
    p.add_argument("--rows", type=positive_int, nargs="+", default=[1, 4, 7, 512])
    add_run_options(p, "bench/results/rows.json", reps=9, sampling=False)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from triforce.formats.loading import load_model
    from triforce.kernels import cpu as kernels
    from triforce.kernels import linear as dispatch
    from triforce.kernels import rows as exact
    from triforce.kv.caches import FullKVCache
    from triforce.lab.synthetic import fill_random_kv

    plain = load_model(None).model
    packed = load_model(None).model
    if not packed.pack_weights():
        print("oneDNN linear kernels unavailable here: nothing to compare", file=sys.stderr)
        return 1
    ours = dispatch.f32_linear
    default_one_row = kernels.f32_one_row_pays()  # the build's choice for decode steps (or $TRIFORCE_ONE_ROW_KERNEL)
    # kind -> (model, what model.Linear calls for 2..64 rows, whether one row takes it too)
    variants = {"ours": (plain, ours, default_one_row), "ours_one_row": (plain, ours, True),
                "onednn": (packed, lambda *a: None, False), "mkl": (plain, lambda *a: None, False)}
    n = args.context
    cache = FullKVCache(plain.cfg, n + max(args.rows) + 1)
    fill_random_kv(cache, n)
    gen = torch.Generator().manual_seed(0)

    def forward(kind: str, ids: torch.Tensor) -> torch.Tensor:
        model, linear, one_row = variants[kind]
        dispatch.f32_linear = linear  # what model.Linear calls for 2-64 rows (None: PyTorch's product)
        exact.ROW_INVARIANT = kind == "ours"  # the others time the paths the exactness rule replaced
        kernels._linear.one_row = one_row  # what kernels.f32_one_row_pays answers
        try:
            return model(ids, torch.arange(n, n + ids.shape[1]), cache, num_logits=ids.shape[1])
        finally:
            dispatch.f32_linear, exact.ROW_INVARIANT, kernels._linear.one_row = ours, True, default_one_row
            cache.rollback(n)

    diffs = {}
    for t in args.rows:
        ids = torch.randint(0, plain.cfg.vocab_size, (1, t), generator=gen)
        ref = forward("mkl", ids)
        diffs[t] = {kind: (forward(kind, ids) - ref).abs().max().item() for kind in variants}
    times = {(kind, t): [] for kind in variants for t in args.rows}
    names = list(variants)
    for rep in range(args.reps):
        for t in args.rows:
            ids = torch.randint(0, plain.cfg.vocab_size, (1, t), generator=gen)
            for kind in names[rep % len(names):] + names[:rep % len(names)]:
                t0 = time.perf_counter()
                forward(kind, ids)
                times[(kind, t)].append(time.perf_counter() - t0)
    rows = []
    for t in args.rows:
        row = {"tokens": t}
        for kind in variants:
            row[f"{kind}_ms"] = round(1000 * statistics.median(times[(kind, t)]), 2)
            row[f"{kind}_max_logit_difference_vs_mkl"] = diffs[t][kind]
        rows.append(row)
    decode = next(r for r in rows if r["tokens"] == min(args.rows))["mkl_ms"]  # the autoregressive decode step
    for r in rows:
        for kind in variants:
            r[f"{kind}_vs_decode"] = round(r[f"{kind}_ms"] / decode, 2)
    out = {"model": "SmolLM2-135M-Instruct", "dtype": "float32", "context": n, "threads": args.threads,
           "reps": args.reps, "interleaved": True, "linear_kernel": kernels.linear_status(),
           "attention_kernel": kernels.status(), "one_row_on_our_kernel_by_default": default_one_row, "rows": rows,
           "command": "python " + " ".join(sys.argv)}
    emit_json(out, args.out)
    print("| tokens per forward | ours (ms) | ours, one row on our kernel (ms) | oneDNN packed (ms) | MKL (ms) "
          "| x the decode step (ours, oneDNN, MKL) | max logit difference vs MKL (ours, oneDNN) |", file=sys.stderr)
    print("|---:|---:|---:|---:|---:|---:|---:|", file=sys.stderr)
    for r in rows:
        print(f"| {r['tokens']} | {r['ours_ms']:.1f} | {r['ours_one_row_ms']:.1f} | {r['onednn_ms']:.1f} | "
              f"{r['mkl_ms']:.1f} | "
              f"{r['ours_vs_decode']:.2f}, {r['onednn_vs_decode']:.2f}, {r['mkl_vs_decode']:.2f} | "
              f"{r['ours_max_logit_difference_vs_mkl']:.1e}, {r['onednn_max_logit_difference_vs_mkl']:.1e} |",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
