"""Where a speculative step's time goes inside a generation: each tier's forwards against everything else.

    python bench/analysis/step_overhead.py --book pg1342.txt --prompt-tokens 8000 --new-tokens 128 --reps 3 \
        --out bench/results/step_overhead_8000_2026-12-05.json

One model generates with ``--mode`` (default ``auto``) in one process, ``--reps`` times with the sampling kernel
(``csrc/sampling.c``) and as many with PyTorch's ops instead (``sampling``: ``kernel`` / ``ops``, alternated; the
prompt's KV cache is reused after the first prefill). Around every tier's ``step`` (one verification, or one token
of a tier with nothing below it) and its ``logits_for`` (the model's forward: the layers and the LM head) a timer
records wall time, from the second token on; per tier and repetition the JSON gives the calls, the milliseconds per
step and per forward, and their difference, ``outside_forward_ms``: what the step spends besides the forwards it
makes itself (top-p, the verification rule and the draw, the caches' bookkeeping, Python), the tiers below excluded
(a verifying tier's step contains its drafter's steps, which are subtracted). Medians over repetitions, and the
time between tokens of each run. On code from before the kernel (a worktree of an older commit, with this script
copied in and ``PYTHONPATH=src``) both arms run the same PyTorch ops. JSON on stdout (and to ``--out``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict

import triforce  # noqa: F401  (first: sets OpenMP's spin before torch loads it, as the product does)

# isort: split
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/, for common.py
from common import add_run_options, emit_json  # noqa: E402


def _sampling_status() -> str:
    try:
        from triforce.kernels.sampling import sampling_status
    except ImportError:
        return "none (code from before csrc/sampling.c)"
    return sampling_status()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--book", default="pg1342.txt")
    p.add_argument("--prompt-tokens", type=int, default=8000)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--mode", default="auto")
    add_run_options(p, None, reps=3)
    args = p.parse_args()

    from triforce.api import TriForce
    from triforce.lab.books import BOOKS_DIR
    from triforce.speculation import sampling, tiers
    from triforce.speculation.hierarchy import SpeculationConfig
    from triforce.speculation.sampling import SamplingParams

    spec = SpeculationConfig(mode=args.mode)
    tf = TriForce.load(threads=args.threads)
    with open(f"{BOOKS_DIR}/{args.book}") as f:
        ids = tf.encode(f.read())[:args.prompt_tokens]
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p)

    clock = {"on": False}
    spent: dict[tuple[str, str], float] = defaultdict(float)  # (tier, "step" | "forward" | "below") -> seconds
    calls: dict[tuple[str, str], int] = defaultdict(int)
    depth: list[str] = []  # the tiers whose step is running, outermost first

    def timed(name, kind):
        real = getattr(tiers.ModelTier, name)

        def run(self, *a, **k):
            t0 = time.perf_counter()
            if kind == "step":
                depth.append(self.name)
            try:
                return real(self, *a, **k)
            finally:
                dt = time.perf_counter() - t0
                if kind == "step":
                    depth.pop()
                    if depth and clock["on"]:  # this step ran inside the caller's
                        spent[(depth[-1], "below")] += dt
                if clock["on"]:
                    spent[(self.name, kind)] += dt
                    calls[(self.name, kind)] += 1
        setattr(tiers.ModelTier, name, run)

    timed("step", "step")
    timed("logits_for", "forward")
    kernel_rows = getattr(sampling, "_kernel_rows", None)  # None: code from before the kernel (both arms alike)
    runs: dict[str, list[dict]] = {"kernel": [], "ops": []}
    for rep in range(2 * args.reps):
        which = ("kernel", "ops")[(rep + rep // 2) % 2]  # kernel, ops, ops, kernel, kernel, ops, ...
        sampling._kernel_rows = kernel_rows if which == "kernel" else (lambda x: None)
        spent.clear(), calls.clear()
        clock["on"] = False
        n, t_first = 0, None
        for _ in tf.stream(ids, max_new_tokens=args.new_tokens, sampling=params, spec=spec, seed=rep):
            n += 1
            if n == 1:
                t_first, clock["on"] = time.perf_counter(), True
        wall = time.perf_counter() - t_first
        clock["on"] = False
        per_tier = {}
        for tier in sorted({t for t, _ in calls}):
            steps, forwards = calls[(tier, "step")], calls[(tier, "forward")]
            own = spent[(tier, "step")] - spent[(tier, "below")]
            per_tier[tier] = {"steps": steps, "forwards": forwards,
                              "step_ms": round(1e3 * own / max(steps, 1), 3),
                              "forward_ms": round(1e3 * spent[(tier, "forward")] / max(forwards, 1), 3),
                              "outside_forward_ms": round(1e3 * (own - spent[(tier, "forward")]) / max(steps, 1), 3)}
        runs[which].append({"time_between_tokens_ms": round(1e3 * wall / max(n - 1, 1), 3), "tiers": per_tier})
    sampling._kernel_rows = kernel_rows

    def median(which: str, key: str, tier: str | None = None) -> float:
        vals = [r["tiers"][tier][key] if tier else r[key] for r in runs[which] if tier is None or tier in r["tiers"]]
        return round(statistics.median(vals), 3) if vals else float("nan")

    tier_names = sorted({t for r in runs["kernel"] + runs["ops"] for t in r["tiers"]})
    summary = {which: {"time_between_tokens_ms": median(which, "time_between_tokens_ms"),
                       "tiers": {t: {k: median(which, k, t) for k in ("step_ms", "forward_ms", "outside_forward_ms")}
                                 for t in tier_names}} for which in runs}
    emit_json({"book": args.book, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
               "mode": args.mode, "temperature": args.temperature, "top_p": args.top_p, "threads": args.threads,
               "reps": args.reps, "sampling_kernel": _sampling_status(),
               "median": summary, "runs": runs,
               "command": "python bench/analysis/step_overhead.py " + " ".join(
                   f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None)}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
