"""Per-tier step latency of the embedded SmolLM2 at one context, for fp32 / int8 / int4 weights (random KV, no prefill).

    python bench/kernels/tier_latency.py --threads 2 --context 1000 [--out PATH]
    python bench/kernels/tier_latency.py --threads 2 --context 8000 --schemes codes --lower-kv-dtypes float32 bfloat16

For each weight scheme of the model under test (fp32 with oneDNN-packed weights, or its GGUF block codes where it has
them; the int8 / int4 copies of ``quant.py``; ``codes``: the block codes with int8 activations) it prints the medians of
:func:`triforce.lab.costmodel.measure_tier_latencies` in milliseconds: ``full_decode`` and ``full_pass`` (gamma2 + 1 = 7
tokens) over a full cache, ``retrieval_decode`` / ``retrieval_pass`` over a retrieval
cache of max(256, context / 8) slots, and ``draft_step`` / ``draft_pass`` of the int4 copy over a StreamingLLM cache
of 16 + 240 tokens (the ``self`` tier); those two caches in each dtype of ``--lower-kv-dtypes``. JSON lines, one per
scheme and dtype. ``bench/kernels/wait_policy.sh`` runs it under three
OpenMP wait settings.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import triforce  # noqa: F401  (first: sets OpenMP's spin before torch loads it, as the product does)

# isort: split
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/, for common.py
from common import add_run_options, positive_int  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=positive_int, default=1000)
    p.add_argument("--lower-kv-dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16", "float16"],
                   help="the retrieval and draft caches' dtypes to time, one line per scheme and dtype "
                        "(the full cache stays fp32)")
    p.add_argument("--schemes", nargs="+", default=["fp32", "int8", "int4", "codes"],
                   choices=["fp32", "int8", "int4", "codes"], help="the weight schemes to time")
    add_run_options(p, None, reps=5, sampling=False, out_help="append the JSON lines to this file too")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from triforce.formats.loading import load_model
    from triforce.lab.costmodel import measure_tier_latencies
    from triforce.model.quant import lower_precision_copy

    model = load_model(None).model
    model.pack_weights()
    int4, int8 = lower_precision_copy(model, "int4"), lower_precision_copy(model, "int8")
    codes = lower_precision_copy(model, "codes")  # the GGUF codes with int8 activations (int8 without codes)
    budget = max(256, args.context // 8)
    keys = ("full_decode", "full_pass", "retrieval_decode", "retrieval_pass", "draft_step", "draft_pass")
    policy = {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    schemes = {"fp32": model, "int8": int8, "int4": int4, "codes": codes}
    for name, lower_kv in itertools.product(args.schemes, args.lower_kv_dtypes):
        row = measure_tier_latencies(schemes[name], int4, [args.context], gamma1=4, gamma2=6, budget=budget,
                                     reps=args.reps, lower_kv=getattr(torch, lower_kv))[0]
        line = {"weights": name, "lower_kv_dtype": lower_kv, "context": args.context, "threads": args.threads,
                "budget": budget, **policy, **{k + "_ms": round(1000 * row[k], 2) for k in keys}}
        print(json.dumps(line), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(line) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
