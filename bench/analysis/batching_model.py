"""The batched cost model (``triforce.lab.batchcost.predict_batch``, MagicDec's roofline analysis): the predicted
speedup of a sparse-KV self-drafting tier (TriForce's retrieval tier) over batched autoregressive decoding, by batch
size and context length.

    python bench/analysis/batching_model.py --out bench/results/batching_model.json

Two machines: this project's CPU with SmolLM2-135M (fp32 verifier, int8 retrieval tier: 540 MB / 135 MB of
weights, 46 KB of KV per position; ``--cpu-gbs`` GB/s, the large fp32 GEMV's bandwidth in docs/history.md, and
``--cpu-gflops`` GFLOP/s, an assumed rate for 2 cores' small-M fp32 products), and MagicDec's A100 with
Llama-2-7B in bf16 (13.5 GB of weights, 0.5 MB of KV per position, 2.0 TB/s, 312 TFLOP/s peak). Acceptance
``--acceptance`` (default 0.78: the retrieval tier's acceptance at 1,000 slots, T = 0.6, 8K tokens of pg1342,
``bench/results/budget_sweep/pg1342_8000_t06_budget1000.json``), gamma 6, a budget of 1/8 of the context
(CPU) or 512 slots (A100, MagicDec's StreamingLLM draft). A roofline ignores every overhead: an upper bound on
both sides of each ratio.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/, for common.py
from common import emit_json  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-gbs", type=float, default=25.0)
    p.add_argument("--cpu-gflops", type=float, default=100.0)
    p.add_argument("--acceptance", type=float, default=0.78)
    p.add_argument("--gamma", type=int, default=6)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 32, 128])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from triforce.lab.batchcost import predict_batch

    machines = {
        "cpu_smollm2": (dict(weight_bytes=540e6, draft_weight_bytes=135e6, kv_bytes_per_slot=2 * 30 * 3 * 64 * 4,
                             flops_per_row=2 * 135e6, bandwidth=args.cpu_gbs * 1e9, flops=args.cpu_gflops * 1e9),
                        (2000, 4000, 8000), lambda n: n // 8),
        "a100_llama2_7b": (dict(weight_bytes=13.5e9, kv_bytes_per_slot=2 * 32 * 32 * 128 * 2,
                                flops_per_row=2 * 6.7e9, bandwidth=2.0e12, flops=312e12),
                           (4000, 32000, 100000), lambda n: 512),
    }
    rows = []
    for name, (hw, contexts, budget) in machines.items():
        for n in contexts:
            for b in args.batches:
                r = predict_batch(b, n, args.gamma, args.acceptance, budget(n), **hw)
                rows.append(dict(machine=name, context=n, batch=b, speedup=round(r["speedup"], 3),
                                 verify_over_decode=round(r["verify_seconds"] / r["autoregressive_step_seconds"], 3)))
    emit_json(dict(benchmark="batching_model", inputs=dict(vars(args)), rows=rows), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
