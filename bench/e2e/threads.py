"""Threads on a shared machine (issue 16): triforce's default thread settings against ``--threads 1``, with and
without another CPU-bound process running.

Runs the README's first command, shortened (``triforce generate --prompt-file BOOK --max-prompt-tokens N
--max-new-tokens M --temperature 0 --json``), in three configurations, interleaved, ``--reps`` times each, on an
idle machine and next to a busy-loop process (``python -c 'while True: pass'``, unpinned):

* ``default``: no ``--threads`` (one thread per physical core other programs leave idle while the model loads) and
  triforce's ``OMP_WAIT_POLICY=PASSIVE``;
* ``threads1``: ``--threads 1``;
* ``passive_all``: ``OMP_WAIT_POLICY=PASSIVE`` and one thread per CPU (what the wait policy alone gives);
* ``before``: one thread per CPU and libgomp's own waiting (``GOMP_SPINCOUNT=300000``, its default spin of ~3 ms,
  which also tells triforce to leave OpenMP alone): torch's defaults, what triforce did before issue 16.

Each run reports decode ms/token (``1000 / decode_tokens_per_second``) and prefill seconds from its ``--json``
object, and the CPU time other programs used meanwhile (all CPUs' busy time from /proc/stat minus this run's own and
the hog's), so a figure taken while someone else was benchmarking says so. Prints one JSON object (``--out`` also
writes it); the medians go to docs/history.md.

    python bench/e2e/threads.py --reps 2 --prompt-tokens 1500 --new-tokens 16 --out bench/results/threads.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import psutil

BOOK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "shared", "data", "books",
                    "pg1342.txt")
ALL = str(len(os.sched_getaffinity(0)))  # torch's (libgomp's) own default: every CPU of the affinity mask
CONFIGS = {
    "default": ([], {}),
    "threads1": (["--threads", "1"], {}),
    "passive_all": (["--threads", ALL], {}),
    "before": (["--threads", ALL], {"GOMP_SPINCOUNT": "300000"}),
}


def busy_seconds() -> float:
    """CPU seconds all CPUs spent not idle since boot (/proc/stat via psutil)."""
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def children_cpu() -> float:
    """CPU seconds (user + system) of this process's finished children."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def one_run(config: str, args: argparse.Namespace, hog: psutil.Process | None) -> dict:
    """Run ``triforce generate`` once in ``config``; returns its decode ms/token, prefill seconds, threads, and the
    CPUs other programs (and the busy loop ``hog``) used meanwhile.

    Raises:
        SystemExit: the command failed (its last stderr line)."""
    extra, env_extra = CONFIGS[config]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME",
                                                             "OMP_NUM_THREADS")}
    env.update(env_extra)
    cmd = [sys.executable, "-m", "triforce", "generate", "--prompt-file", args.book, "--max-prompt-tokens",
           str(args.prompt_tokens), "--max-new-tokens", str(args.new_tokens), "--temperature", "0", "--json",
           "--no-progress", *extra]
    hog_cpu0 = sum(hog.cpu_times()[:2]) if hog else 0.0
    busy0, own0, t0 = busy_seconds(), children_cpu(), time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    wall = time.monotonic() - t0
    own = children_cpu() - own0
    hog_cpu = (sum(hog.cpu_times()[:2]) - hog_cpu0) if hog else 0.0
    others = max(0.0, busy_seconds() - busy0 - own - hog_cpu)
    if proc.returncode != 0:
        raise SystemExit(f"{config}: exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}")
    d = json.loads(proc.stdout)
    return {"config": config, "decode_ms_per_token": round(1000 / d["decode_tokens_per_second"], 2),
            "prefill_seconds": round(d["prefill_seconds"], 3), "generated_tokens": d["generated_tokens"],
            "prompt_tokens": d["prompt_tokens"], "threads": d["threads"], "carriage_returns": d["text"].count("\r"),
            "wall_seconds": round(wall, 2),
            "other_programs_cpus": round(others / wall, 2), "hog_cpus": round(hog_cpu / wall, 2)}


def main() -> int:
    """Command line: see the module docstring; returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--book", default=BOOK)
    p.add_argument("--prompt-tokens", type=int, default=1500)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--conditions", default="idle,busy", help="comma-separated: idle, busy")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated among {', '.join(CONFIGS)}")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args()
    configs = args.configs.split(",")
    if any(c not in CONFIGS for c in configs):
        p.error(f"--configs must be among {', '.join(CONFIGS)}, got {args.configs!r}")
    result = {"command": " ".join(sys.argv), "cpus": os.cpu_count(), "load_average_at_start": os.getloadavg(),
              "conditions": {}}
    for condition in args.conditions.split(","):
        hog_proc = hog = None
        if condition == "busy":
            hog_proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            hog = psutil.Process(hog_proc.pid)
            time.sleep(1)
        try:
            runs = [one_run(c, args, hog) for _ in range(args.reps) for c in configs]
        finally:
            if hog_proc is not None:
                hog_proc.kill()
                hog_proc.wait()
        summary = {}
        for c in configs:
            mine = [r for r in runs if r["config"] == c]
            summary[c] = {k: statistics.median(r[k] for r in mine)
                          for k in ("decode_ms_per_token", "prefill_seconds", "other_programs_cpus", "threads")}
        if "default" in summary and "threads1" in summary:
            best = min(summary[c]["decode_ms_per_token"] for c in ("default", "threads1"))
            summary["default_over_best"] = round(summary["default"]["decode_ms_per_token"] / best, 3)
        result["conditions"][condition] = {"summary": summary, "runs": runs}
        print(json.dumps({condition: summary}), file=sys.stderr, flush=True)
        if args.out:  # after each condition, so a run cut short keeps what it measured
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                f.write(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
