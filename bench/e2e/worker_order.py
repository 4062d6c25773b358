"""Is a gap between two ``triforce bench`` workers the method's, the worker process's, or its place in the order?

``triforce bench`` runs one worker process per method and, in every repetition, the methods in one fixed order
(:data:`triforce.lab.bench.methods.METHODS` order), so ``auto`` always runs right before ``autoregressive``, and its
worker is the one that loads first and tokenizes the prompt. Where ``auto`` decodes plainly (SmolLM2 at 1K and 4K
tokens: the same code as ``autoregressive``), runs measured it at 0.86-1.03x (docs/history.md). This script
separates the three candidate causes with the bench's own workers: it starts one worker per entry of ``--workers``
(duplicates allowed: ``autoregressive,autoregressive,auto`` is an A/A/B test), tokenizes the prompt in a worker of
its own that then exits (``--encode-in own``) or in the first worker (``first``, as ``triforce bench`` does), and
runs the repetitions in a fixed order or rotated by one place per repetition (``--order rotate``), so that every
worker runs in every place equally often.

A ``--workers`` entry ``METHOD:thp`` runs that worker with 2 MiB pages for its tensors (``THP_MEM_ALLOC_ENABLE=1``,
what ``import triforce`` now sets, ``triforce/hugepages.py``), a plain ``METHOD`` with 4 KiB pages (``0``, PyTorch's
own default), so the two page sizes compare in one run.

Output (JSON): each run's mean time between tokens (ms, the engine's own ``mean_time_between_tokens_ms``) with its
worker and place, the medians by worker and by place, and each worker's ``AnonHugePages`` at the end (KiB).

    R=bench/results/worker_order_2026-12-04
    python bench/e2e/worker_order.py --book pg2701.txt --prompt-tokens 1000 --reps 8 --order rotate \
        --workers autoregressive,autoregressive:thp,autoregressive,autoregressive:thp --out $R/pg2701_1000_thp.json
    python bench/e2e/worker_order.py --book pg2701.txt --prompt-tokens 4000 --reps 8 --order rotate \
        --workers autoregressive,autoregressive:thp,autoregressive,autoregressive:thp --out $R/pg2701_4000_thp.json
    python bench/e2e/worker_order.py --book pg1342.txt --prompt-tokens 8000 --reps 6 --order rotate \
        --workers autoregressive,autoregressive:thp,auto,auto:thp --out $R/pg1342_8000_thp.json
    python bench/e2e/worker_order.py --book pg2701.txt --prompt-tokens 1000 --reps 8 --order fixed --encode-in first \
        --workers auto:thp,autoregressive:thp,autoregressive:thp,autoregressive:thp --out $R/pg2701_1000_aaaa.json
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import triforce  # noqa: F401  (first: sets OpenMP's spin before torch loads it, as the product does)

# isort: split
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/, for common.py
from common import add_run_options, emit_json  # noqa: E402
from triforce.defaults import DEFAULTS  # noqa: E402
from triforce.kernels.hugepages import HUGE_PAGES_VAR  # noqa: E402
from triforce.lab.bench.methods import (  # noqa: E402
    METHODS,
    PAUSE_BETWEEN_RUNS_S,
    WARMUP_NEW_TOKENS,
    WARMUP_PROMPT_TOKENS,
)
from triforce.lab.bench.worker import Worker  # noqa: E402
from triforce.lab.books import BOOKS_DIR  # noqa: E402

THP_SUFFIX = ":thp"  # a --workers entry METHOD:thp runs with 2 MiB pages for its CPU tensors (triforce/hugepages.py)


def _start(entry: str, cfg: dict, log_dir: str) -> Worker:
    """A loaded worker for a ``--workers`` entry: ``METHOD:thp`` with ``THP_MEM_ALLOC_ENABLE=1``, ``METHOD`` with
    ``0`` (4 KiB pages, what PyTorch does by itself; ``import triforce`` would otherwise set ``1``,
    ``triforce/hugepages.py``)."""
    method = entry.removesuffix(THP_SUFFIX)
    saved = os.environ.get(HUGE_PAGES_VAR)
    os.environ[HUGE_PAGES_VAR] = "1" if entry.endswith(THP_SUFFIX) else "0"
    try:
        w = Worker(method, cfg, log_dir)  # the subprocess inherits this environment
    finally:
        os.environ.pop(HUGE_PAGES_VAR, None)
        if saved is not None:
            os.environ[HUGE_PAGES_VAR] = saved
    w.receive()
    return w


def _anon_huge_pages_kib(pid: int) -> int | None:
    """``AnonHugePages`` of a process (KiB of its memory the kernel backs with 2 MiB pages; None off Linux)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:"))
    except (OSError, StopIteration):
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--book", default="pg2701.txt", help="a file in ../shared/data/books (default pg2701.txt)")
    p.add_argument("--prompt-tokens", type=int, default=4000)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--workers", default="autoregressive,autoregressive,auto",
                   help="comma-separated methods, one worker each; duplicates allowed; METHOD:thp: that worker "
                        "with 2 MiB pages for its tensors (THP_MEM_ALLOC_ENABLE=1), METHOD: with 4 KiB pages (0)")
    p.add_argument("--order", choices=("fixed", "rotate"), default="rotate")
    p.add_argument("--encode-in", choices=("first", "own"), default="own",
                   help="tokenize the prompt in the first worker (as triforce bench does) or in a worker of its own")
    p.add_argument("--seed", type=int, default=4)
    add_run_options(p, None, reps=6)
    a = p.parse_args(argv)
    methods = [m.strip() for m in a.workers.split(",")]
    bad = [m for m in methods if METHODS.get(m.removesuffix(THP_SUFFIX), ("",))[0] != "ours"]
    if bad or len(methods) < 2:
        ours = ", ".join(m for m, f in METHODS.items() if f[0] == "ours")
        p.error(f"--workers: at least two of our methods ({ours}), got {a.workers!r}")
    if a.reps < 1 or a.prompt_tokens < 1 or a.new_tokens < 1:
        p.error("--reps, --prompt-tokens and --new-tokens must be >= 1")
    if not os.path.isfile(os.path.join(BOOKS_DIR, a.book)):
        p.error(f"--book: no file {a.book!r} in {BOOKS_DIR}")
    # a worker's config as `triforce bench` writes it, with the options of docs/history.md's 1K and 4K runs
    cfg = {"model": None, "draft": None, "dtype": "float32", "threads": a.threads, "temperature": a.temperature,
           "top_p": a.top_p, "top_k": 0, "seed": a.seed, "budget": 1000, "chunk_size": DEFAULTS["chunk_size"],
           "gamma1": DEFAULTS["gamma1"], "gamma2": DEFAULTS["gamma2"], "synthetic": None, "layers": None,
           "packed_weights": "auto"}
    with open(os.path.join(BOOKS_DIR, a.book), encoding="utf-8") as f:
        text = f.read()
    log_dir = tempfile.mkdtemp(prefix="worker-order-")
    workers: list[Worker] = []
    try:
        if a.encode_in == "own":
            enc = Worker("autoregressive", cfg, log_dir)
            enc.receive()
            ids = enc.request(cmd="encode", text=text, max_prompt_tokens=a.prompt_tokens)["ids"]
            enc.close()
        for i, m in enumerate(methods):  # one after another, as triforce bench loads them
            w = _start(m, cfg, log_dir)
            workers.append(w)
            if i == 0 and a.encode_in == "first":
                ids = w.request(cmd="encode", text=text, max_prompt_tokens=a.prompt_tokens)["ids"]
        runs = []
        for rep in range(-1, a.reps):  # rep -1: the warm-up, as in triforce bench
            shift = rep % len(workers) if a.order == "rotate" and rep >= 0 else 0
            order = [(k + shift) % len(workers) for k in range(len(workers))]
            for place, i in enumerate(order):
                w = workers[i]
                if rep < 0:
                    w.request(cmd="run", ids=ids[:WARMUP_PROMPT_TOKENS], new_tokens=WARMUP_NEW_TOKENS, seed=a.seed)
                else:
                    r = w.request(cmd="run", ids=ids, new_tokens=a.new_tokens, seed=a.seed + rep)
                    runs.append({"rep": rep, "worker": i, "method": methods[i], "place": place,
                                 "ms": r["stats"]["mean_time_between_tokens_ms"]})
                    print(f"rep {rep} place {place} worker {i} ({methods[i]}): {runs[-1]['ms']:.2f} ms",
                          file=sys.stderr)
                time.sleep(PAUSE_BETWEEN_RUNS_S)
        huge = [_anon_huge_pages_kib(w.proc.pid) for w in workers]
    finally:
        for w in workers:
            w.close()
        shutil.rmtree(log_dir, ignore_errors=True)
    # medians over every repetition, as triforce bench's
    by_worker = {f"{i} {m}": round(statistics.median(r["ms"] for r in runs if r["worker"] == i), 3)
                 for i, m in enumerate(methods)}
    by_place = {str(k): round(statistics.median(r["ms"] for r in runs if r["place"] == k), 3)
                for k in range(len(methods))}
    emit_json({"command": "python bench/e2e/worker_order.py " + " ".join(sys.argv[1:] if argv is None else argv),
               "tokens": len(ids), "runs": runs, "median_ms_by_worker": by_worker, "median_ms_by_place": by_place,
               "anon_huge_pages_kib_by_worker": {f"{i} {m}": h for i, (m, h) in enumerate(zip(methods, huge))}},
              a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
