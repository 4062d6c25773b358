"""The one-call decode step (``csrc/decode_step.c``) of this tree against a build of an earlier source, in the
forwards ``auto`` runs at a long context.

    git show HEAD~1:src/triforce/kernels/csrc/decode_step.c > /tmp/decode_step_before.c
    python bench/kernels/step_source.py --baseline-source /tmp/decode_step_before.c --context 8000 --reps 21 \
        --out bench/results/step_source.json

For the embedded SmolLM2 (the verifier on its GGUF block codes) at ``--context`` tokens of random KV
(``triforce.lab.synthetic.fill_random_kv``; each forward rolled back, so every repetition sees the same context),
three forwards, each as the product runs it (``Transformer.forward``: embedding, the layers in one C call, the final
norm and the LM head):

* ``full_decode``: the verifier's decode step over the full cache (what autoregressive decoding runs per token);
* ``full_pass``: its verification block of ``--tokens`` tokens (``auto``'s under sampling: gamma2 3, 4 tokens);
* ``retrieval_decode``: the retrieval tier ``auto`` gives it under sampling (the same codes with int8 activations
  over ``--budget`` bf16 slots).

Each runs with the layers' C function from this tree (``ours``) and from ``--baseline-source`` built with the same
flags (``baseline``), the two builds alternated every repetition (order flipped), ``--calls`` forwards per turn;
medians (ms) and ``baseline_over_ours``. The two builds' logits are compared for the same inputs (the largest
absolute difference, whether every row's argmax agrees), and each build's against the same forward with the layers
called from Python (``Block.forward``, PyTorch's ops). Over random KV the retrieval tier's int8 activations make its
logits chaotic: a different rounding of one activation moves them by far more than the rounding itself, so compare
its two distances to the Python layers rather than expect the builds to agree. JSON on stdout (and to ``--out``).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time
from pathlib import Path

import triforce  # noqa: F401  (first: sets OpenMP's spin before torch loads it, as the product does)

# isort: split
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/, for common.py
from common import add_run_options, emit_json, random_kv_steps  # noqa: E402
from triforce.defaults import DEFAULTS  # noqa: E402
from triforce.speculation.auto import retrieval_budget  # noqa: E402

CHUNK = DEFAULTS["chunk_size"]  # the retrieval cache's chunk, as auto builds it


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline-source", required=True, type=Path, help="an earlier csrc/decode_step.c")
    p.add_argument("--context", type=int, default=8000, help="tokens in the KV cache (8000)")
    p.add_argument("--budget", type=int, help="retrieval cache slots, chunk size (8) to --context (default: auto's "
                   "under sampling, 1000 at 8K)")
    p.add_argument("--tokens", type=int, default=4, help="tokens of the verification block (4: gamma2 3)")
    p.add_argument("--calls", type=int, default=3, help="forwards of each kind per turn of a build (3)")
    add_run_options(p, None, reps=15, sampling=False)
    args = p.parse_args()
    if not args.baseline_source.is_file():
        p.error(f"--baseline-source: no such file: {args.baseline_source}")
    for name in ("context", "tokens", "calls"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    from triforce.kernels.decode_step import MAX_BLOCK
    if args.tokens > MAX_BLOCK:
        p.error(f"--tokens must be at most {MAX_BLOCK} (one call's block), got {args.tokens}")
    if args.budget is None:
        args.budget = min(args.context, retrieval_budget(args.context, greedy=False))
    if not CHUNK <= args.budget <= args.context:
        p.error(f"--budget must lie in [chunk size {CHUNK}, --context {args.context}], got {args.budget}")
    torch.set_num_threads(args.threads)

    # the baseline built and its function found before the model loads
    from triforce.formats.download import cache_dir
    from triforce.kernels import cpu as kernels
    from triforce.kernels import decode_step

    try:
        lib = ctypes.CDLL(str(kernels._build(cache_dir() / "kernels", args.baseline_source.resolve(),
                                             kernels.DECODE_STEP_CFLAGS)))
        base_fn = lib.triforce_decode_layers
    except (OSError, RuntimeError, AttributeError) as e:
        p.error(f"--baseline-source {args.baseline_source}: not a csrc/decode_step.c with triforce_decode_layers "
                f"({str(e).strip()[-300:]})")

    n, t = args.context, args.tokens
    model, codes, full, retrieval = random_kv_steps(n, args.budget, n + t + 2)
    cfg = model.cfg
    gen = torch.Generator().manual_seed(0)
    kinds = {"full_decode": (model, full, 1), "full_pass": (model, full, t), "retrieval_decode": (codes, retrieval, 1)}
    inputs = {k: torch.randint(0, cfg.vocab_size, (1, rows), generator=gen) for k, (_, _, rows) in kinds.items()}

    def forward(kind: str) -> torch.Tensor:
        m, cache, rows = kinds[kind]
        logits = m(inputs[kind], torch.arange(n, n + rows), cache, num_logits=rows)
        cache.rollback(n)
        return logits

    forward("full_decode")  # loads this tree's kernels
    if not decode_step.decode_step_status().startswith("on"):
        raise SystemExit(f"the one-call decode step is {decode_step.decode_step_status()}")
    ours = decode_step._decode_step.fns
    base_fn.restype, base_fn.argtypes = ours["triforce_decode_layers"].restype, ours["triforce_decode_layers"].argtypes
    builds = {"ours": ours, "baseline": dict(ours, triforce_decode_layers=base_fn)}

    logits, times = {}, {(k, b): [] for k in kinds for b in builds}
    try:
        for rep in range(args.reps):
            for build in (("ours", "baseline") if rep % 2 == 0 else ("baseline", "ours")):
                decode_step._decode_step.fns = builds[build]
                for kind in kinds:
                    for _ in range(args.calls):
                        t0 = time.perf_counter()
                        out = forward(kind)
                        times[(kind, build)].append(1e3 * (time.perf_counter() - t0))
                    logits[(kind, build)] = out
    finally:
        decode_step._decode_step.fns = ours
    python = {}  # the same forwards with the layers called from Python (Block.forward): PyTorch's SiLU
    for kind, (m, _, _) in kinds.items():
        one_call, m.decode_step = m.decode_step, None
        try:
            python[kind] = forward(kind)
        finally:
            m.decode_step = one_call
    steps = {}
    for kind in kinds:
        a, b = logits[(kind, "ours")], logits[(kind, "baseline")]
        ours_ms, base_ms = statistics.median(times[(kind, "ours")]), statistics.median(times[(kind, "baseline")])
        steps[kind] = {"rows": kinds[kind][2], "ours_ms": round(ours_ms, 3), "baseline_ms": round(base_ms, 3),
                       "baseline_over_ours": round(base_ms / ours_ms, 3),
                       "logits_max_abs_diff": float((a - b).abs().max()),
                       "argmax_equal": bool(torch.equal(a.argmax(-1), b.argmax(-1))),
                       "ours_to_python_max_abs_diff": float((a - python[kind]).abs().max()),
                       "baseline_to_python_max_abs_diff": float((b - python[kind]).abs().max()),
                       "logits_max_abs": float(python[kind].abs().max())}
    emit_json({"model": "SmolLM2-135M-Instruct (embedded; verifier on its block codes, retrieval tier on them with "
                        "int8 activations)",
               "context": n, "budget": args.budget, "tokens": t, "threads": args.threads, "reps": args.reps,
               "calls": args.calls, "baseline_source": str(args.baseline_source), "steps": steps}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
