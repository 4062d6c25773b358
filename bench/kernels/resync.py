"""What a retrieval tier pays to catch up after a bypass: a re-selection of its chunks against a pass over the missed
tokens (``RetrievalTier.CATCH_UP_TOKENS``).

    python bench/kernels/resync.py --threads 2 --context 8000 --reps 9 \
        --out bench/results/cost_model_2026-12-04/resync.json

For the embedded SmolLM2 and the retrieval tier ``auto`` gives it under sampling (the verifier's GGUF block codes
with int8 activations over ``--budget`` slots), over random KV (``triforce.lab.synthetic.fill_random_kv``), timed
interleaved in one loop (order rotated), medians in ms: ``build`` (``RetrievalCache.build``: score every chunk of
the context with a query and copy the chosen ones, what a re-selection costs) and ``pass_T`` (the tier's forward
over T tokens, rolled back after each call: a catch-up over T - 1 missed tokens plus the step's own). JSON on stdout
(and to ``--out``).
"""

from __future__ import annotations

import argparse
import os
import sys

import triforce  # noqa: F401  (first: sets OpenMP's spin before torch loads it, as the product does)

# isort: split
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/, for common.py
from common import _interleaved, add_run_options, emit_json  # noqa: E402
from triforce.defaults import DEFAULTS  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=8000, help="tokens in the KV cache (8000)")
    p.add_argument("--budget", type=int, default=1000, help="retrieval cache slots (1000: auto's at 8K, sampling)")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 5, 9, 17], help="pass lengths T (1 5 9 17)")
    add_run_options(p, None, reps=9, sampling=False)
    args = p.parse_args()
    for name in ("context", "budget", "reps", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if any(t < 1 for t in args.tokens) or max(args.tokens) + DEFAULTS["chunk_size"] + 2 > args.budget:
        p.error(f"--tokens must be >= 1 and fit in the budget beside a chunk, got {args.tokens}")
    torch.set_num_threads(args.threads)

    from triforce.formats.loading import load_model
    from triforce.kv.caches import FullKVCache
    from triforce.kv.retrieval import RetrievalCache
    from triforce.lab.synthetic import fill_random_kv, random_query
    from triforce.model.quant import lower_precision_copy

    model = load_model(None).model
    codes = lower_precision_copy(model, "codes")
    cfg, n = model.cfg, args.context
    capacity = n + max(args.tokens) + 2
    model.set_request_length(capacity)
    codes.set_request_length(capacity)
    full = FullKVCache(cfg, capacity, model.dtype, model.device)
    fill_random_kv(full, n, 0)
    retrieval = RetrievalCache(cfg, full, args.budget, DEFAULTS["chunk_size"])
    query = random_query(cfg)
    retrieval.build(n, query)
    gen = torch.Generator().manual_seed(0)

    def build() -> None:
        retrieval.build(n, query)

    def forward(t: int):
        def run() -> None:
            codes(torch.randint(0, cfg.vocab_size, (1, t), generator=gen), torch.arange(n, n + t), retrieval,
                  num_logits=t)
            retrieval.rollback(n)
        return run

    measured = _interleaved({"build": build, **{f"pass_{t}": forward(t) for t in args.tokens}}, args.reps)
    out = {"model": "SmolLM2-135M-Instruct (embedded; retrieval tier on its block codes with int8 activations)",
           "context": n, "budget": args.budget, "threads": args.threads, "reps": args.reps,
           "median_ms": {k: round(1000 * v, 2) for k, v in measured.items()}}
    emit_json(out, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
