"""Per-step traces of ``auto``'s hierarchy with the governor never bypassing, and the governor's rule replayed on them.

    OMP_WAIT_POLICY=PASSIVE python bench/analysis/governor_trace.py --threads 2 --reps 4 --books pg1342.txt pg84.txt \\
        pg2701.txt --prompt-tokens 8000 --new-tokens 128 --out bench/results/governor_trace_8000.json

For each book and repetition, on the embedded default model (as ``triforce generate`` runs it, weights packed
where that pays), in one process, alternately:

* ``autoregressive``: plain decoding of the prompt; each step's wall time (the request's decode time per token,
  what the governor should hold speculation against);
* ``auto``: the hierarchy :func:`~triforce.speculation.auto.choose_hierarchy` chooses, its
:class:`~triforce.speculation.auto.SpeedGovernor`
  replaced by one that probes ``--probe`` decode steps as the governor does and then never bypasses: each
  speculative step's wall time (``step`` + ``commit``, as the engine times it) and the tokens it emitted.

The same seed per repetition for both, so the texts agree until the first rejection. Then two bypass rules are
replayed on each trace (``first_bypass_step``: the index, from 0, of the speculative step at which a rule would first
have bypassed drafting, null: never; the first speculative step, 0, is never timed, so the index is also the number
of timed steps at the bypass), each given the probe's decode times the governor would have had:

* ``governor``: :class:`~triforce.speculation.auto.SpeedGovernor` as it is (the window's tokens per step against the
  break-even, from the lower quartiles of the step times);
* ``previous``: the rule it replaced (the time per token of the last 8 and 32 steps against the median of the
  probe's decode steps).

``tokens_per_step`` (the tokens emitted with the drafters over the speculative steps) against
``break_even_tokens_per_step`` (the governor's estimate over the whole request but its first step, a catch-up, and
its last, cut short by ``--new-tokens``; the plain run's decode steps as the reference) says whether the hierarchy
paid in that repetition; where it paid, every
bypass is a loss. ``--slowdown`` replays the same traces with every speculative step that many times slower (a
hierarchy that does not pay), where a rule should bypass early. JSON on stdout and to ``--out``.
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
from triforce.speculation.auto import SpeedGovernor, lower_quartile  # noqa: E402


class _Recorder(SpeedGovernor):
    """A :class:`SpeedGovernor` that records every step and never bypasses."""

    def __init__(self, top, probe: int) -> None:
        super().__init__(top, probe=probe, min_steps=10**9, window=10**9)
        self.trace: list[tuple[float, int, bool]] = []

    def after_step(self, seconds: float, tokens: int) -> None:
        self.trace.append((seconds, tokens, bool(self.top.drafting)))
        super().after_step(seconds, tokens)


class _Top:
    """The part of a :class:`~triforce.speculation.tiers.ModelTier` a governor touches."""

    drafter = object()
    drafting = False

    def resume_drafting(self, seq) -> None:
        self.drafting = True


def _speculative(trace, slowdown: float) -> list[tuple[float, int]]:
    """The speculative steps of a trace, (seconds x slowdown, tokens)."""
    return [(s * slowdown, t) for s, t, drafting in trace if drafting]


def replay(trace: list, decode_probe: list[float], slowdown: float = 1.0, **settings) -> int | None:
    """The index of the speculative step at which a :class:`SpeedGovernor` (``settings``) fed this trace would first
    bypass drafting, or None. ``decode_probe``: the probe's decode times per token (seconds), as many as it probes."""
    gov = SpeedGovernor(_Top(), probe=len(decode_probe), **settings)
    gov.after_step(0.0, 1)  # the prefill's token
    for d in decode_probe:
        gov.before_step([])
        gov.after_step(d, 1)
    gov.before_step([])
    assert gov.top.drafting
    for i, (seconds, tokens) in enumerate(_speculative(trace, slowdown)):
        gov.after_step(seconds, tokens)
        if not gov.top.drafting:
            return i
    return None


def replay_previous(trace: list, decode_probe: list[float], slowdown: float = 1.0) -> int | None:
    """The same for the rule the governor had before (commit 5d94244): bypass when the time per token over the last
    8 timed steps and over the last 32 exceeds the median of the probe's decode steps (first check at 8 steps; the
    first speculative step untimed)."""
    decode = statistics.median(decode_probe)
    timed: list[tuple[float, int]] = []
    for i, step in enumerate(_speculative(trace, slowdown)):
        if i == 0:
            continue
        timed.append(step)
        if len(timed) >= 8 and all(sum(s for s, _ in w) / sum(t for _, t in w) > decode
                                   for w in (timed[-8:], timed[-32:])):
            return i
    return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--books", nargs="+", default=["pg1342.txt", "pg84.txt", "pg2701.txt"])
    p.add_argument("--prompt-tokens", type=int, default=8000)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--probe", type=int, default=SpeedGovernor.probe, help="decode steps before drafting")
    p.add_argument("--slowdown", type=float, nargs="+", default=[1.0, 1.3, 1.6],
                   help="replay with every speculative step this many times slower")
    p.add_argument("--seed", type=int, default=0)
    add_run_options(p, None, reps=4)
    args = p.parse_args()
    for name in ("prompt_tokens", "new_tokens", "reps", "threads", "probe"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if any(s <= 0 for s in args.slowdown):
        p.error(f"--slowdown must be > 0, got {args.slowdown}")
    torch.set_num_threads(args.threads)

    from triforce.engine import Engine, SpeculationConfig
    from triforce.formats.loading import load_model
    from triforce.lab.books import book_prompt, resolve_book
    from triforce.speculation.sampling import SamplingParams

    lm = load_model(None)
    if lm.model.packing_pays():
        lm.model.pack_weights()
    engine = Engine(lm.model, None, eos_ids=())
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=0)
    recorders: list[_Recorder] = []

    def factory(top):
        recorders.append(_Recorder(top, args.probe))
        return recorders[-1]

    engine.governor_factory = factory
    runs = []
    for book in args.books:
        ids = book_prompt(lm.tokenizer, resolve_book(book), args.prompt_tokens)
        for rep in range(args.reps):
            seed = args.seed + rep
            order = ["autoregressive", "auto"] if rep % 2 == 0 else ["auto", "autoregressive"]
            run = {"book": book, "rep": rep, "seed": seed}
            for mode in order:
                if mode == "autoregressive":
                    times, last = [], None
                    for _ in engine.stream(ids, max_new_tokens=args.new_tokens, sampling=sampling,
                                           spec=SpeculationConfig(mode="autoregressive"), seed=seed):
                        now = time.perf_counter()
                        if last is not None:
                            times.append(now - last)
                        last = now
                    run["decode_seconds"] = times
                else:
                    engine.generate(ids, max_new_tokens=args.new_tokens, sampling=sampling,
                                    spec=SpeculationConfig(mode="auto"), seed=seed)
                    run["hierarchy"] = engine.last_stats.auto["hierarchy"]
                    run["trace"] = [[round(s, 6), t, d] for s, t, d in recorders[-1].trace]
            runs.append(run)
            print(f"{book} rep {rep}: done", file=sys.stderr, flush=True)

    summary = []  # the replays use the probe this run recorded (--probe)
    for run in runs:
        decode = statistics.median(run["decode_seconds"])
        spec = [(s, t) for s, t, d in run["trace"] if d]
        probe = [s / t for s, t, d in run["trace"][1:] if not d][:args.probe]  # the prefill's token: untimed
        spec_seconds = [s for s, _ in spec[1:-1]]  # untimed first step (as the governor); last: cut by --new-tokens
        row = {"book": run["book"], "rep": run["rep"], "hierarchy": run["hierarchy"],
               "decode_ms_per_token": round(1000 * decode, 2),
               "probe_ms_per_token": [round(1000 * x, 2) for x in probe],
               "speculative_ms_per_token": round(1000 * sum(s for s, _ in spec) / max(1, sum(t for _, t in spec)), 2),
               "speculative_steps": len(spec),
               "tokens_per_step": round(sum(t for _, t in spec) / max(1, len(spec)), 2)}
        if spec_seconds:  # the governor's break-even over the whole request, against the plain run's decode steps
            row["break_even_tokens_per_step"] = round(lower_quartile(spec_seconds)
                                                      / lower_quartile(run["decode_seconds"]), 2)
        row["first_bypass_step"] = {f"x{k}": {"governor": replay(run["trace"], probe, k),
                                               "previous": replay_previous(run["trace"], probe, k)}
                                    for k in args.slowdown} if probe else {}
        summary.append(row)
    emit_json({"benchmark": "governor_trace", "settings": vars(args), "summary": summary, "runs": runs}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
