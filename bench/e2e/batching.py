"""Continuous batching: total decode throughput and time between tokens, batched against one at a time.

    python bench/e2e/batching.py --prompt-tokens 2000 4000 --batches 1 2 4 8 --new-tokens 64 --threads 2 \
        --out bench/results/batching.json --png bench/results/batching.png

For each prompt length (the first N tokens of a book, default pg1342) and each hierarchy (``autoregressive``, and
``retrieval`` with int8 weights and a budget of 1/8 of the prompt, what ``--mode auto`` picks at T = 0.6), B
sequences generate ``--new-tokens`` tokens each at T = 0.6 / top-p 0.9 with their own seeds:

* ``batched``: all B at once through :class:`~triforce.model.batching.BatchScheduler` (what ``triforce serve
  --max-batch`` runs);
* ``one at a time``: the same B sequences one after another (what the server did before, and does with
  ``--max-batch 1``).

Every sequence starts from its own copy of the prompt's KV cache, computed once (the server's prefix cache; the
prefill is compute-bound and costs both sides the same), so the figures are the decode phase: total throughput
(generated tokens / wall time) and the time between a sequence's consecutive tokens (p50, p99, over every token of
every sequence; tokens of one verified block arrive together). Repetitions interleave batched and one-at-a-time runs.
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


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of ``values`` by linear interpolation (numpy's default)."""
    import numpy as np

    return float(np.quantile(np.asarray(values), q)) if values else 0.0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--book", default="pg1342")
    p.add_argument("--prompt-tokens", type=int, nargs="+", default=[2000, 4000])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--modes", nargs="+", default=["autoregressive", "retrieval"],
                   choices=["autoregressive", "retrieval"])
    p.add_argument("--png", default=None, help="also plot total throughput against batch size there")
    add_run_options(p, None, reps=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from triforce import SamplingParams, SpeculationConfig, TriForce
    from triforce.kv.caches import FullKVCache
    from triforce.lab.books import book_prompt, resolve_book
    from triforce.model.batching import BatchScheduler

    tf = TriForce.load(args.model, threads=args.threads)
    model = tf.target.model
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p)
    rows = []
    for n in args.prompt_tokens:
        ids = book_prompt(tf.tokenizer, resolve_book(args.book), n)
        warm = tf.fork()
        warm.generate(ids, max_new_tokens=1, sampling=sampling, spec=SpeculationConfig())
        source = warm.engine.full_cache  # the prompt's KV, computed once
        specs = {"autoregressive": SpeculationConfig(),
                 "retrieval": SpeculationConfig(mode="retrieval", budget=max(64, n // 8), lower_weights="int8")}

        def run(views, spec, batched: bool, seed0: int) -> dict:
            """Generate with every view (each from a copy of the prompt's KV); throughput and token gaps."""
            gaps: list[float] = []
            tokens = [0]
            for v in views:
                cache = FullKVCache(model.cfg, n + args.new_tokens + 64, tf.engine.kv_dtype, model.device)
                cache.copy_prefix_from(source, n)
                v.engine.adopt_prefix(cache, ids)

            def job(v, seed):
                last = None
                for _ in v.stream(ids, max_new_tokens=args.new_tokens, sampling=sampling, spec=spec, seed=seed):
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append(now - last)
                    last = now
                    tokens[0] += 1

            t0 = time.perf_counter()
            if batched:
                seqs = BatchScheduler(len(views)).run([lambda v=v, i=i: job(v, seed0 + i) for i, v in enumerate(views)])
                for s in seqs:
                    if s.error is not None:
                        raise s.error
            else:
                for i, v in enumerate(views):
                    job(v, seed0 + i)
            wall = time.perf_counter() - t0
            return dict(tokens=tokens[0], seconds=wall, gaps=gaps)

        for mode in args.modes:
            spec = specs[mode]
            for b in args.batches:
                views = [tf.fork() for _ in range(b)]
                run(views[:1], spec, False, 999)  # warm-up, untimed: the int8 copy, the kernels' first calls
                results = {"batched": [], "one_at_a_time": []}
                for r in range(args.reps):
                    for kind in ("batched", "one_at_a_time") if r % 2 == 0 else ("one_at_a_time", "batched"):
                        results[kind].append(run(views, spec, kind == "batched", 1000 * r))
                row = dict(prompt_tokens=n, mode=mode, batch=b, new_tokens=args.new_tokens)
                for kind, runs in results.items():
                    tps = [x["tokens"] / x["seconds"] for x in runs]
                    gaps = [g for x in runs for g in x["gaps"]]
                    row[kind] = dict(tokens_per_second=round(statistics.median(tps), 3),
                                     tbt_p50_ms=round(1000 * percentile(gaps, 0.5), 3),
                                     tbt_p99_ms=round(1000 * percentile(gaps, 0.99), 3),
                                     per_rep_tokens_per_second=[round(t, 3) for t in tps])
                row["batched_over_one_at_a_time"] = round(row["batched"]["tokens_per_second"]
                                                          / row["one_at_a_time"]["tokens_per_second"], 3)
                rows.append(row)
                print(f"# {n} tokens, {mode}, batch {b}: batched {row['batched']['tokens_per_second']:.1f} tok/s, "
                      f"one at a time {row['one_at_a_time']['tokens_per_second']:.1f} tok/s "
                      f"({row['batched_over_one_at_a_time']:.2f}x)", flush=True)
                del views
    out = dict(benchmark="batching", model=tf.target.source or "SmolLM2-135M-Instruct", book=args.book,
               threads=args.threads, temperature=args.temperature, top_p=args.top_p, reps=args.reps, rows=rows)
    emit_json(out, args.out)
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(args.prompt_tokens), figsize=(5 * len(args.prompt_tokens), 4), squeeze=False)
        for ax, n in zip(axes[0], args.prompt_tokens):
            for mode in args.modes:
                sel = [r for r in rows if r["prompt_tokens"] == n and r["mode"] == mode]
                bs = [r["batch"] for r in sel]
                ax.plot(bs, [r["batched"]["tokens_per_second"] for r in sel], "o-", label=f"{mode}, batched")
                ax.plot(bs, [r["one_at_a_time"]["tokens_per_second"] for r in sel], "x--",
                        label=f"{mode}, one at a time")
            ax.set_xscale("log", base=2)
            ax.set_xticks(args.batches, [str(b) for b in args.batches])
            ax.set_xlabel("concurrent sequences")
            ax.set_ylabel("total tokens/s")
            ax.set_title(f"{n}-token prompts, T = {args.temperature:g}")
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(args.png, dpi=120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
