"""What the retrieval tier's int8 decode step costs in one kernel call against one Python call per operation.

The retrieval tier (TriForce, arXiv 2404.11912, Sec. 4.1) runs the target's int8 copy over a retrieval cache of
``--budget`` slots. Its decode step runs every layer in one call (``csrc/decode_step.c``,
``decode_step.decode_layers``) unless ``TRIFORCE_DECODE_STEP_KERNEL=0``. This script times, interleaved over
``--reps`` in one process (medians, ms), on the embedded SmolLM2 (or ``--model``) at ``--context`` tokens
(caches filled with random KV, no prefill; rolled back after each step):

* ``one_call``: the step as the product runs it;
* ``python``: the same step with the layers called from Python (the model's ``decode_step`` unset);
* ``int8_products``: the step's int8 products alone, one kernel call each from a Python loop;
* ``attention``: the step's attention alone, one kernel call per layer;
* ``decode_fp32``: the fp32 target's decode step over the full cache (what autoregressive decoding runs).

and the largest difference of the two steps' logits. JSON output; a Markdown table on stdout.

    python bench/kernels/decode_step.py --context 8000 --reps 15 --threads 2 --out bench/results/decode_step.json
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
from common import add_run_options, emit_json  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder, GGUF file or hub id (default: the embedded SmolLM2)")
    p.add_argument("--context", type=int, default=8000)
    p.add_argument("--budget", type=int, default=1000, help="retrieval cache slots (auto's at 8K: 1000)")
    add_run_options(p, "bench/results/decode_step.json", reps=15, sampling=False)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from triforce.formats.loading import load_model
    from triforce.kernels import cpu as kernels
    from triforce.kernels import decode_step
    from triforce.kv.caches import FullKVCache
    from triforce.lab.synthetic import fill_random_kv
    from triforce.model.quant import Int8Linear, lower_precision_copy

    model = load_model(args.model).model
    model.pack_weights()
    low = lower_precision_copy(model, "int8")
    if low.decode_step is None or not decode_step.decode_step_status().startswith("on"):
        print(f"the one-call decode step does not apply here ({decode_step.decode_step_status()})", file=sys.stderr)
        return 1
    cfg, n = model.cfg, args.context
    for m in (model, low):
        m.set_request_length(n + 2)
    full = FullKVCache(cfg, n + 2)
    fill_random_kv(full, n)
    ret = triforce.kv.retrieval.RetrievalCache(cfg, full, args.budget, 8)
    fill_random_kv(ret, n, 1)
    one_call = low.decode_step
    gen = torch.Generator().manual_seed(0)
    linears = [m for m in low.modules() if isinstance(m, Int8Linear)]
    xs = [torch.randn(1, lin.q.shape[1], generator=gen) for lin in linears]
    q = torch.randn(1, cfg.num_attention_heads, 1, cfg.head_dim, generator=gen)

    def step(decode_step) -> torch.Tensor:
        low.decode_step = decode_step
        try:
            return low(ids, torch.tensor([n]), ret, num_logits=1)
        finally:
            low.decode_step = one_call
            ret.rollback(n)

    def decode_fp32() -> None:
        model(ids, torch.tensor([n]), full, num_logits=1)
        full.rollback(n)

    kinds = {"one_call": lambda: step(one_call), "python": lambda: step(None),
             "int8_products": lambda: [kernels.int8_linear(x, lin.q, lin.scale_f32) for lin, x in zip(linears, xs)],
             "attention": lambda: [kernels.gqa_attention_kernel(q, ret.k[i], ret.v[i], ret.budget)
                                   for i in range(cfg.num_hidden_layers)],
             "decode_fp32": decode_fp32}
    ids = torch.randint(0, cfg.vocab_size, (1, 1), generator=gen)
    difference = (step(one_call) - step(None)).abs().max().item()
    for f in kinds.values():  # warm-up
        f()
    times = {k: [] for k in kinds}
    names = list(kinds)
    for rep in range(args.reps):
        ids = torch.randint(0, cfg.vocab_size, (1, 1), generator=gen)
        for k in names[rep % len(names):] + names[:rep % len(names)]:
            t0 = time.perf_counter()
            kinds[k]()
            times[k].append(time.perf_counter() - t0)
    ms = {k: round(1000 * statistics.median(v), 2) for k, v in times.items()}
    weight_bytes = sum(lin.q.numel() for lin in linears)
    out = {"model": args.model or "SmolLM2-135M-Instruct (embedded)", "context": n, "budget": args.budget,
           "threads": args.threads, "reps": args.reps, "interleaved": True,
           "decode_step_kernel": decode_step.decode_step_status(), "ms": ms,
           "python_over_one_call": round(ms["python"] / ms["one_call"], 2),
           "decode_fp32_over_one_call": round(ms["decode_fp32"] / ms["one_call"], 2),
           "int8_weight_bytes": weight_bytes,
           "int8_products_gb_per_s": round(weight_bytes / ms["int8_products"] / 1e6, 1),
           "max_logit_difference": difference, "command": "python " + " ".join(sys.argv)}
    emit_json(out, args.out)
    print("| step | ms |\n|---|---:|", file=sys.stderr)
    for k, v in ms.items():
        print(f"| {k} | {v:.1f} |", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
