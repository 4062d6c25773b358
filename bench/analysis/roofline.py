"""What bounds speculation on this machine: each tier's step against its floor, and the speedup the floors allow.

    python bench/analysis/roofline.py --threads 2 --context 8000 --reps 9 \
        --out bench/results/roofline_8000_2026-12-04.json
    python bench/analysis/roofline.py --threads 2 --context 8000 --reps 15 \
        --out bench/results/roofline_split_8000_2026-12-04.json
    python bench/analysis/roofline.py --threads 2 --context 8000 --reps 15 --gamma2 3 --tokens-per-verification 3 \
        --out bench/results/roofline_stream_8000_2026-12-05.json
    python bench/analysis/roofline.py --model ~/.cache/triforce/qwen2.5-coder/qwen-coder-1.5b.gguf --threads 2 \
        --context 32000 --budget 4000 --reps 9 --gamma2 3 --tokens-per-verification 3.08 \
        --out bench/results/long/roofline_qwen15b_32000.json

For the embedded SmolLM2 or a GGUF file (``--model``; the verifier on its block codes) and the retrieval tier
``auto`` gives it under sampling (the same codes with int8 activations, ``--lower-weights codes``, over ``--budget``
slots), at one context:

* the machine's two ceilings, measured in the same interleaved loop as the steps (this machine's speed drifts
  between phases): ``bandwidth`` (the memory's read rate, ``common.stream_probe``; ``gemv_gb_per_s`` beside it is a
  large fp32 GEMV's, the bandwidth these floors used before 2026-12-05, 1.9x lower on this project's EPYC) and
  ``peak`` (a large fp32 GEMM's FLOP rate through oneDNN, ``common.gemm_probe``; MKL's, which the floors used before,
  runs AVX2 code on AMD CPUs at about 0.45x of it);
* per step, the bytes it reads (weights as the step reads them, ``Transformer.step_weight_bytes``, plus the keys and
  values it attends over) and the FLOPs it does (2 per weight and row, 4 * heads * head_dim per key and query row),
  and its ``floor_ms = max(bytes / bandwidth, flops / peak)``: no implementation on this machine beats it by much
  (``peak`` is what MKL's large GEMM reaches, not the FMA units' nominal rate);
* per step, the measured median over random KV (``triforce.lab.synthetic.fill_random_kv``; the three steps
  interleaved in one loop, order rotated): ``full_decode`` (the verifier, one token), ``full_pass`` (the verifier,
  gamma2 + 1 tokens), ``retrieval_decode`` (the retrieval tier, one token);
* the decode step split in two (item 2 of issue 11: decode within 1.15x of its floor): ``short_decode``, the same
  verifier over a ``--short-context``-token cache (64), timed in the same loop, is the weights' part (every product,
  the LM head included, plus the step's fixed costs; its attention reads 64 keys); ``full_decode - short_decode``
  is the part that grows with the context, attention over the other keys; each against its own floor (the weights'
  bytes, the KV cache's bytes, at ``bandwidth``);
* the verification split the same way (``pass_split``): ``short_pass``, gamma2 + 1 rows over the short cache, is
  its products' part; ``full_pass - short_pass`` its attention, with that attention's FLOPs and their rate;
* the speedup over autoregressive decoding of ``retrieval:gamma2`` with tau tokens per verification,
  ``tau * t_decode / (t_pass + gamma2 * t_retrieval)``, from the measured steps and from the floors, for the tau
  given (``--tokens-per-verification``: what the bench measured) and for tau = gamma2 + 1 (every proposal
  accepted: the ceiling of the hierarchy).

The formula leaves out the retrieval cache's selection, the sampling and rejection over the vocabulary, and in
``auto`` the governor's probes and bypasses, so ``triforce bench`` measures less than its ``measured`` speedup.
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
from common import (  # noqa: E402
    _interleaved,
    add_run_options,
    emit_json,
    gemm_probe,
    gemv_probe,
    random_kv_steps,
    stream_probe,
)
from triforce.defaults import DEFAULTS, PRECISIONS  # noqa: E402
from triforce.speculation.auto import retrieval_budget  # noqa: E402


def _speedup(tau: float, gamma: int, decode: float, verify: float, propose: float) -> float:
    """tau * t_decode / (t_pass + gamma * t_retrieval): tokens per cycle over the cycle's time in decode steps."""
    return tau * decode / (verify + gamma * propose)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a GGUF file instead of the embedded SmolLM2 (its block codes)")
    p.add_argument("--precision", choices=PRECISIONS,
                   help="the verifier's arithmetic (load_model's default: file for a GGUF file, exact for the embedded "
                        "model)")
    p.add_argument("--context", type=int, default=8000, help="tokens in the KV cache (8000)")
    p.add_argument("--budget", type=int, help="retrieval cache slots (default: auto's under sampling, "
                   "triforce.speculation.auto.retrieval_budget: 1000 at 8K)")
    p.add_argument("--gamma2", type=int, default=DEFAULTS["gamma2"], help="proposals per verification")
    p.add_argument("--tokens-per-verification", type=float, default=5.5,
                   help="tau, tokens emitted per verification (5.5: `triforce bench` at 8K, T = 0.6)")
    p.add_argument("--lower-kv-dtype", choices=["float32", "bfloat16"], default="bfloat16",
                   help="the retrieval cache's dtype (bfloat16: auto's where our attention kernel reads it)")
    p.add_argument("--short-context", type=int, default=64,
                   help="tokens in the cache of short_decode, the decode step without its long attention (64)")
    add_run_options(p, None, reps=7, sampling=False)
    args = p.parse_args()
    if args.budget is None:
        args.budget = retrieval_budget(args.context, greedy=False)
    for name in ("context", "budget", "gamma2", "reps", "threads", "short_context"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 1 <= args.tokens_per_verification <= args.gamma2 + 1:
        p.error(f"--tokens-per-verification must lie in [1, gamma2 + 1 = {args.gamma2 + 1}], "
                f"got {args.tokens_per_verification}")
    if args.short_context >= args.context:
        p.error(f"--short-context must be below --context ({args.context}), got {args.short_context}")
    torch.set_num_threads(args.threads)

    from triforce.kv.caches import FullKVCache, kv_bytes
    from triforce.lab.synthetic import fill_random_kv
    from triforce.model.transformer import Linear

    n, g = args.context, args.gamma2
    # random KV; each forward below rolled back so that every repetition sees the same context (as
    # measure_tier_latencies), the three steps timed interleaved in one loop (the machine's speed drifts between phases)
    model, codes, full, retrieval = random_kv_steps(n, args.budget, n + g + 2, args.lower_kv_dtype, args.model,
                                                     args.precision)
    cfg, lower_kv = model.cfg, getattr(torch, args.lower_kv_dtype)
    weights = sum(m.codes.in_features * m.codes.out_features if m.weight_t is None else m.weight_t.numel()
                  for m in model.modules() if isinstance(m, Linear))  # every product's weights (K-quants: codes only)
    attn_per_key = 4 * cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers  # QK^T and PV, per query row

    short = FullKVCache(cfg, n + g + 2, model.dtype, model.device)  # same capacity: only the keys read differ
    fill_random_kv(short, args.short_context, 2)
    gen = torch.Generator().manual_seed(0)

    def forward(m, cache, t: int, at: int = n):
        def run() -> None:
            m(torch.randint(0, cfg.vocab_size, (1, t), generator=gen), torch.arange(at, at + t), cache, num_logits=t)
            cache.rollback(at)
        return run

    (stream, stream_bytes), (gemv, gemv_bytes), (gemm, gemm_flops) = stream_probe(), gemv_probe(), gemm_probe()
    measured = _interleaved({"full_decode": forward(model, full, 1), "full_pass": forward(model, full, g + 1),
                             "retrieval_decode": forward(codes, retrieval, 1),
                             "short_decode": forward(model, short, 1, args.short_context),
                             "short_pass": forward(model, short, g + 1, args.short_context), "stream": stream,
                             "gemv": gemv, "gemm": gemm}, args.reps)
    bw, peak = stream_bytes / measured.pop("stream"), gemm_flops / measured.pop("gemm")
    gemv_bw = gemv_bytes / measured.pop("gemv")

    def step(weight_bytes: int, slots: int, rows: int, kv_dtype: torch.dtype = model.dtype) -> dict:
        nbytes = weight_bytes + kv_bytes(cfg, slots, kv_dtype)
        flops = 2 * weights * rows + attn_per_key * slots * rows
        return {"rows": rows, "mb": round(nbytes / 1e6, 1), "gflop": round(flops / 1e9, 2),
                "memory_ms": round(1000 * nbytes / bw, 2), "compute_ms": round(1000 * flops / peak, 2),
                "floor_ms": round(1000 * max(nbytes / bw, flops / peak), 2)}

    steps = {"full_decode": step(model.step_weight_bytes(), n, 1),
             "full_pass": step(model.step_weight_bytes(), n, g + 1),
             "retrieval_decode": step(codes.step_weight_bytes(), args.budget, 1, lower_kv),
             "short_decode": step(model.step_weight_bytes(), args.short_context, 1),
             "short_pass": step(model.step_weight_bytes(), args.short_context, g + 1)}
    short_ms = 1000 * measured["short_decode"]
    attention_ms = 1000 * (measured["full_decode"] - measured["short_decode"])
    attention_floor = 1000 * kv_bytes(cfg, n - args.short_context, model.dtype) / bw
    decode_split = {  # the decode step = its weights' part (short_decode) + attention over the other keys
        "weights_part": {"measured_ms": round(short_ms, 2), "floor_ms": steps["short_decode"]["floor_ms"],
                         "measured_over_floor": round(short_ms / steps["short_decode"]["floor_ms"], 2)},
        "attention_part": {"keys": n - args.short_context, "measured_ms": round(attention_ms, 2),
                           "floor_ms": round(attention_floor, 2),
                           "measured_over_floor": round(attention_ms / attention_floor, 2)}}
    attn_gflop = attn_per_key * (n - args.short_context) * (g + 1) / 1e9
    pass_ms = 1000 * (measured["full_pass"] - measured["short_pass"])
    pass_split = {  # the verification the same way: its products' part and its gamma2 + 1 rows' attention
        "weights_part": {"measured_ms": round(1000 * measured["short_pass"], 2)},
        "attention_part": {"measured_ms": round(pass_ms, 2), "gflop": round(attn_gflop, 2),
                           "gflop_per_s": round(attn_gflop / pass_ms * 1000, 1),
                           "memory_floor_ms": round(attention_floor, 2),
                           "compute_floor_ms": round(1000 * attn_gflop * 1e9 / peak, 2)}}
    for key, seconds in measured.items():
        steps[key]["measured_ms"] = round(1000 * seconds, 2)
        steps[key]["measured_over_floor"] = round(1000 * seconds / steps[key]["floor_ms"], 2)

    def speedups(kind: str) -> dict:
        t = {k: v[kind] for k, v in steps.items()}
        return {f"tau_{tau:g}": round(_speedup(tau, g, t["full_decode"], t["full_pass"], t["retrieval_decode"]), 3)
                for tau in (args.tokens_per_verification, g + 1)}

    out = {"model": f"{os.path.basename(args.model) if args.model else 'SmolLM2-135M-Instruct (embedded)'}; verifier "
                    "on its block codes, retrieval tier on them with int8 activations",
           "precision": model.precision, "context": n, "budget": args.budget, "lower_kv_dtype": args.lower_kv_dtype,
           "gamma2": g,
           "threads": args.threads, "reps": args.reps,
           "bandwidth_gb_per_s": round(bw / 1e9, 2), "gemv_gb_per_s": round(gemv_bw / 1e9, 2),
           "peak_gflop_per_s": round(peak / 1e9, 1),
           "steps": steps, "decode_split": decode_split, "pass_split": pass_split,
           "pass_over_decode": {"measured": round(steps["full_pass"]["measured_ms"]
                                                  / steps["full_decode"]["measured_ms"], 2),
                                "floor": round(steps["full_pass"]["floor_ms"] / steps["full_decode"]["floor_ms"], 2)},
           "speedup_retrieval": {"measured": speedups("measured_ms"), "floor": speedups("floor_ms")}}
    emit_json(out, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
