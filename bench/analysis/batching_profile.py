"""Where a batched decode step's time goes: cProfile of B autoregressive sequences decoding together.

    python bench/analysis/batching_profile.py --prompt-tokens 4000 --batch 4 --new-tokens 48 --threads 2

B sequences (each from its own copy of the prompt's KV, T = 0.6) decode ``--new-tokens`` tokens each through
:class:`~triforce.model.batching.BatchScheduler`; prints the batched and one-at-a-time throughput of two interleaved
runs, then the profile of one more batched run: seconds per call of the attention kernel (one layer of one sequence)
and of the projections (one weight matrix over the batch's rows), and the bandwidth each implies from the bytes it
reads, and the 25 functions with the most own time (ms per batched step). Prints JSON.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

import triforce  # noqa: F401  (first: sets OpenMP's spin before torch loads it, as the product does)

# isort: split
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/, for common.py
from common import add_prompt_options, add_run_options, emit_json  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=4)
    add_prompt_options(p, prompt_tokens=4000, new_tokens=48)
    add_run_options(p, None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from triforce import SamplingParams, SpeculationConfig, TriForce
    from triforce.kv.caches import FullKVCache, kv_bytes
    from triforce.lab.books import book_prompt, resolve_book
    from triforce.model.batching import BatchScheduler

    tf = TriForce.load(None, threads=args.threads)
    model, n, b, g = tf.target.model, args.prompt_tokens, args.batch, args.new_tokens
    ids = book_prompt(tf.tokenizer, resolve_book(args.book), n)
    warm = tf.fork()
    warm.generate(ids, max_new_tokens=1, spec=SpeculationConfig())
    source = warm.engine.full_cache
    sampling = SamplingParams(args.temperature, args.top_p)

    def run(batched: bool) -> float:
        views = [tf.fork() for _ in range(b)]
        for v in views:
            cache = FullKVCache(model.cfg, n + g + 64, tf.engine.kv_dtype, model.device)
            cache.copy_prefix_from(source, n)
            v.engine.adopt_prefix(cache, ids)
        jobs = [lambda v=v, i=i: v.generate(ids, max_new_tokens=g, sampling=sampling, spec=SpeculationConfig(),
                                            seed=i) for i, v in enumerate(views)]
        t0 = time.perf_counter()
        if batched:
            BatchScheduler(b).run(jobs)
        else:
            for job in jobs:
                job()
        return b * g / (time.perf_counter() - t0)

    run(True)  # warm-up
    rates = {"batched": [], "one_at_a_time": []}
    for _ in range(2):
        rates["one_at_a_time"].append(run(False))
        rates["batched"].append(run(True))
    prof = cProfile.Profile()
    prof.enable()
    run(True)
    prof.disable()
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (cc, nc, tottime, cumtime, callers)

    def total(name: str) -> tuple[int, float]:
        hits = [(v[1], v[2]) for k, v in stats.items() if k[2] == name]
        return (sum(h[0] for h in hits), sum(h[1] for h in hits)) if hits else (0, 0.0)

    attn_calls, attn_s = total("gqa_attention_kernel")
    lin_calls, lin_s = total("<built-in method torch._ops.mkldnn._linear_pointwise>")
    steps = g  # one batched forward per generated token (autoregressive)
    kv_layer = kv_bytes(model.cfg, n, tf.engine.kv_dtype) / model.cfg.num_hidden_layers  # one sequence, one layer
    weights = model.weight_bytes()
    out = dict(benchmark="batching_profile", prompt_tokens=n, batch=b, new_tokens=g, threads=args.threads,
               tokens_per_second={k: [round(x, 2) for x in v] for k, v in rates.items()},
               attention=dict(calls=attn_calls, seconds=round(attn_s, 3),
                              ms_per_call=round(1000 * attn_s / max(attn_calls, 1), 3),
                              gb_per_s=round(kv_layer * attn_calls / max(attn_s, 1e-9) / 1e9, 2)),
               projections=dict(calls=lin_calls, seconds=round(lin_s, 3),
                                ms_per_step=round(1000 * lin_s / steps, 2),
                                gb_per_s=round(weights * steps / max(lin_s, 1e-9) / 1e9, 2)),
               profiled_seconds=round(sum(v[2] for v in stats.values()), 3),
               top_own_time=[dict(function=f"{k[2]} ({os.path.basename(k[0])}:{k[1]})", calls=v[1],
                                  seconds=round(v[2], 3), ms_per_step=round(1000 * v[2] / steps, 2))
                             for k, v in sorted(stats.items(), key=lambda kv: -kv[1][2])[:25]])
    emit_json(out, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
