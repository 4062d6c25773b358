"""Two modes on one loaded model, in one process: what `triforce bench`'s one-worker-per-method layout cannot tell.

`triforce bench` runs each method in its own worker process, so two methods that run the same algorithm (``auto``
planning plain decoding at 4K tokens, and ``autoregressive``) can still differ by a worker's luck (where its memory
landed, which core it shared). Here one model generates with each ``--modes`` entry in turn, the order alternated
between repetitions, and the medians of the engine's time between tokens are compared:

    python bench/e2e/same_process.py --book pg2701.txt --prompt-tokens 4000 --new-tokens 64 --reps 3 \
        --modes auto autoregressive --out bench/results/same_process_pg2701_4000.json

A ``--modes`` entry is a mode with optional :class:`~triforce.speculation.hierarchy.SpeculationConfig` fields after
commas, so one process can also compare settings of one mode, e.g. gamma2 of ``auto`` (``auto,gamma2=3``; numbers are
read as numbers, ``true`` / ``false`` as bools, ``none`` as None):

    python bench/e2e/same_process.py --book pg1342.txt --prompt-tokens 8000 --new-tokens 128 --reps 5 \
        --modes autoregressive auto,gamma2=3 auto,gamma2=6

JSON on stdout (and to ``--out``): per mode the time between tokens of each repetition (ms), the median, what
``auto`` chose and what its governor measured in each repetition, and each mode's median over the first mode's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import triforce  # noqa: F401  (first: sets OpenMP's spin before torch loads it, as the product does)

# isort: split
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/, for common.py
from common import add_run_options, emit_json  # noqa: E402


def _number(value: str):
    """``value`` as a bool (``true`` / ``false``), an int, else a float, else the text itself."""
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def _spec(entry: str, config_class):
    """``MODE[,FIELD=VALUE...]`` -> the SpeculationConfig (numbers as int or float, ``true`` / ``false`` as bools,
    ``none`` as None, other values as text); exits with a message naming the entry where it does not make one."""
    mode, *fields = entry.split(",")
    kwargs = {}
    for f in fields:
        key, sep, value = f.partition("=")
        if not sep:
            raise SystemExit(f"--modes: {entry!r}: expected FIELD=VALUE after the mode, got {f!r}")
        kwargs[key] = None if value.lower() == "none" else _number(value)
    try:
        return config_class(mode=mode, **kwargs)
    except (TypeError, ValueError) as e:
        raise SystemExit(f"--modes: {entry!r}: {e}") from e


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--book", default="pg2701.txt")
    p.add_argument("--prompt-tokens", type=int, default=4000)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--modes", nargs="+", default=["auto", "autoregressive"],
                   help="MODE[,FIELD=VALUE...]: a mode and SpeculationConfig fields (e.g. auto,gamma2=3)")
    add_run_options(p, None, reps=3)
    args = p.parse_args()

    from triforce.api import TriForce
    from triforce.lab.books import BOOKS_DIR
    from triforce.speculation.hierarchy import SpeculationConfig
    from triforce.speculation.sampling import SamplingParams

    specs = {m: _spec(m, SpeculationConfig) for m in args.modes}  # bad entries fail before the model loads
    tf = TriForce.load(threads=args.threads)
    with open(f"{BOOKS_DIR}/{args.book}") as f:
        ids = tf.encode(f.read())[:args.prompt_tokens]
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p)
    tbt: dict[str, list[float]] = {m: [] for m in args.modes}
    chose: dict[str, str] = {}
    governor: dict[str, list[dict]] = {}  # per repetition: what auto's governor saw, and the acceptance
    for rep in range(args.reps):
        order = args.modes if rep % 2 == 0 else args.modes[::-1]
        for mode in order:
            stats = tf.generate(ids, max_new_tokens=args.new_tokens, spec=specs[mode],
                                sampling=sampling, seed=rep).stats
            tbt[mode].append(round(stats.mean_time_between_tokens_ms, 2))
            if stats.auto:
                chose[mode] = stats.auto["hierarchy"]
                governor.setdefault(mode, []).append(
                    {k: v for k, v in stats.auto.items() if k not in ("hierarchy", "reason", "budget")}
                    | {"acceptance": {name: t.get("acceptance_rate") for name, t in stats.tiers.items()},
                       "tokens_per_verification": {name: t.get("mean_tokens_per_verification")
                                                   for name, t in stats.tiers.items()}})
    medians = {m: statistics.median(v) for m, v in tbt.items()}
    first = args.modes[0]
    out = {"book": args.book, "prompt_tokens": len(ids), "new_tokens": args.new_tokens,
           "temperature": args.temperature, "top_p": args.top_p, "threads": args.threads, "reps": args.reps,
           "time_between_tokens_ms": tbt, "median_ms": medians, "auto_hierarchy": chose, "auto_governor": governor,
           f"median_vs_{first}": {m: round(medians[m] / medians[first], 3) for m in args.modes},
           "command": "python " + " ".join(sys.argv)}
    emit_json(out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
