"""Top-p (nucleus) and the draw, cost per call: ``sampling.logits_to_probs`` against the full-vocabulary sort it
replaced, ``sampling.sample`` against ``torch.multinomial``, each with the sampling kernel (``csrc/sampling.c``) and
with PyTorch's ops (``ops``: the same rule without it, what ``TRIFORCE_SAMPLING_KERNEL=0`` runs).

    python bench/kernels/nucleus.py --threads 2 --reps 50 --out bench/results/nucleus.json
    python bench/kernels/nucleus.py --threads 2 --reps 200 --out bench/results/nucleus_kernel_2026-12-05.json

Rows of SmolLM2's 49,152-token vocabulary, T = 0.6, top-p 0.9, for 1 row (a decode step) and 7 rows (a 7-token
verification): ``logits_to_probs`` (the nucleus among the ``NUCLEUS_CANDIDATES`` most likely tokens, a sort only
for rows where they hold less than top_p) against transformers' ``TopPLogitsWarper`` rule with a full sort (the
previous implementation); and the draw of one token per row from the result: ``sampling.sample`` (inverse CDF) against
``torch.multinomial`` (what it replaced). Logits are the default model's own at positions of a book (its real
peakedness), or, with ``--flat``, N(0, 0.05) noise, where every row takes the sort fallback. Interleaved repetitions,
medians.
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


def sort_rule(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The previous top-p: a full ascending sort of every row (transformers' ``TopPLogitsWarper``)."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
    remove_sorted = sorted_logits.softmax(-1).cumsum(-1) <= 1 - top_p
    remove_sorted[..., -1] = False
    return torch.softmax(logits.masked_fill(remove_sorted.scatter(-1, order, remove_sorted), float("-inf")), -1)


def median_ms(kinds: dict, reps: int) -> dict:
    """Median milliseconds per call of each callable, over ``reps`` interleaved repetitions (order reversed every
    other one)."""
    times = {k: [] for k in kinds}
    for rep in range(reps):
        for k in (list(kinds) if rep % 2 == 0 else list(kinds)[::-1]):
            t0 = time.perf_counter()
            kinds[k]()
            times[k].append(time.perf_counter() - t0)
    return {k: round(1e3 * statistics.median(v), 3) for k, v in times.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flat", action="store_true", help="noise logits: every row takes the sort fallback")
    add_run_options(p, None, reps=50, out_help="write the JSON there")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from triforce.speculation.sampling import SamplingParams, logits_to_probs, sample

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p)
    if args.flat:
        logits = torch.randn(7, 49152, generator=torch.Generator().manual_seed(0)) * 0.05
        source = "N(0, 0.05) noise"
    else:
        from triforce.formats.loading import load_model
        from triforce.kv.caches import FullKVCache
        from triforce.lab.books import book_prompt, resolve_book

        loaded = load_model(None)
        ids = book_prompt(loaded.tokenizer, resolve_book("pg1342.txt"), 512)
        model = loaded.model
        with torch.inference_mode():
            out = model(torch.tensor([ids]), torch.arange(len(ids)), FullKVCache(model.cfg, len(ids)),
                        num_logits=len(ids))
        logits = out[0, -7:].float()  # (7, V): the model's logits at the last 7 positions
        source = "SmolLM2-135M-Instruct's logits at the last 7 of 512 tokens of pg1342"
    from triforce.kernels.sampling import sampling_status
    from triforce.speculation import sampling

    kernel_rows = sampling._kernel_rows

    def ops(fn):  # fn with PyTorch's ops instead of the sampling kernel
        def run():
            sampling._kernel_rows = lambda x: None
            try:
                return fn()
            finally:
                sampling._kernel_rows = kernel_rows
        return run

    results = []
    for rows in (1, 7):
        x = logits[:rows] / params.temperature
        ours = lambda: logits_to_probs(logits[:rows], params)  # noqa: E731
        assert torch.allclose(ours(), sort_rule(x, params.top_p), atol=1e-6)
        assert torch.equal(ours() > 0, ops(ours)() > 0) and torch.allclose(ours(), ops(ours)(), atol=1e-6)
        ms = median_ms({"ours": ours, "ops": ops(ours), "sort": lambda: sort_rule(x, params.top_p)}, args.reps)
        # the draw from the nucleus: sampling.sample (inverse CDF) against torch.multinomial, one draw per row
        probs, gen = ours(), torch.Generator().manual_seed(0)
        draw = lambda: sample(probs, gen)  # noqa: E731
        dms = median_ms({"ours": draw, "ops": ops(draw),
                         "multinomial": lambda: torch.multinomial(probs, 1, generator=gen)}, args.reps)
        results.append({"rows": rows, "ours_ms": ms["ours"], "ops_ms": ms["ops"], "sort_ms": ms["sort"],
                        "speedup": round(ms["sort"] / ms["ours"], 2),
                        "kernel_speedup": round(ms["ops"] / ms["ours"], 2),
                        "nucleus_sizes": (ours() > 0).sum(-1).tolist(),
                        "draw_ours_ms": dms["ours"], "draw_ops_ms": dms["ops"],
                        "draw_multinomial_ms": dms["multinomial"],
                        "draw_speedup": round(dms["multinomial"] / dms["ours"], 2),
                        "draw_kernel_speedup": round(dms["ops"] / dms["ours"], 2)})
    emit_json({"threads": args.threads, "reps": args.reps, "temperature": params.temperature, "top_p": params.top_p,
               "logits": source, "sampling_kernel": sampling_status(), "results": results}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
