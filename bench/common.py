"""What the benchmark scripts share: the options every timed run takes (defaults from ``triforce.defaults``), and
writing the JSON result (with the machine it was measured on)."""

from __future__ import annotations

import argparse
import json
import os

from triforce.defaults import DEFAULTS


def add_run_options(p: argparse.ArgumentParser, out: str | None, reps: int = 1, threads: int | None = 2,
                    sampling: bool = True, out_help: str = "also write the JSON here") -> None:
    """Add ``--temperature`` / ``--top-p`` (with ``sampling``; defaults: ``triforce.defaults``), ``--reps``,
    ``--threads`` and ``--out`` (default ``out``; None: stdout only)."""
    if sampling:
        p.add_argument("--temperature", type=float, default=DEFAULTS["temperature"])
        p.add_argument("--top-p", type=float, default=DEFAULTS["top_p"])
    p.add_argument("--reps", type=int, default=reps)
    p.add_argument("--threads", type=int, default=threads)
    p.add_argument("--out", default=out, help=out_help if out is None else f"JSON output ({out})")


def machine() -> dict:
    """The CPU a result was measured on: ``{"cpu": model name, "cores": logical CPUs, "isa": "AVX-512" | "AVX2" |
    "other"}`` (the kernels' builds differ by ISA, and figures differ between this project's machines)."""
    name, flags = "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and name == "unknown":
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    isa = "AVX-512" if {"avx512f", "avx512bw", "avx512vl"} <= flags else "AVX2" if {"avx2", "fma"} <= flags else "other"
    return {"cpu": name, "cores": os.cpu_count(), "isa": isa}


def emit_json(obj, path: str | None) -> str:
    """Print ``obj`` as indented JSON (a dict gains a ``machine`` entry, :func:`machine`) and, with ``path``, write it
    there too; returns the text."""
    if isinstance(obj, dict):
        obj = {**obj, "machine": obj.get("machine", machine())}
    text = json.dumps(obj, indent=2)
    print(text)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")
    return text
