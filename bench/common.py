"""What the benchmark scripts share: the options every timed run takes (defaults from ``triforce.defaults``), and
writing the JSON result (with the machine it was measured on)."""

from __future__ import annotations

import argparse
import json

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
    """The CPU a result was measured on: ``triforce.kernels.cpu()``, ``{"cpu", "cores", "isa"}`` (the kernels' builds
    differ by ISA, and figures differ between this project's machines)."""
    from triforce.kernels import cpu

    return cpu()


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
