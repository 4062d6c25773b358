"""What the benchmark scripts share: the options every timed run takes (defaults from ``triforce.defaults``),
writing the JSON result (with the machine it was measured on), interleaved timing, and the machine's two ceilings
(the large-GEMV bandwidth and the large-GEMM FLOP rate)."""

from __future__ import annotations

import argparse
import json
import statistics
import time

from triforce.defaults import DEFAULTS


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (row counts, repetitions, threads, contexts), refused before any model loads."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def add_run_options(p: argparse.ArgumentParser, out: str | None, reps: int = 1, threads: int | None = 2,
                    sampling: bool = True, out_help: str = "also write the JSON here") -> None:
    """Add ``--temperature`` / ``--top-p`` (with ``sampling``; defaults: ``triforce.defaults``), ``--reps``,
    ``--threads`` and ``--out`` (default ``out``; None: stdout only)."""
    if sampling:
        p.add_argument("--temperature", type=float, default=DEFAULTS["temperature"])
        p.add_argument("--top-p", type=float, default=DEFAULTS["top_p"])
    p.add_argument("--reps", type=positive_int, default=reps)
    p.add_argument("--threads", type=positive_int, default=threads)
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


def _timed(fn) -> float:
    """Wall seconds of one call of ``fn``."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _interleaved(fns: dict, reps: int) -> dict[str, float]:
    """Median seconds of each callable, one untimed warm-up each, order rotated between repetitions."""
    names = list(fns)
    for n in names:
        fns[n]()
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(reps):
        for n in names[r % len(names):] + names[:r % len(names)]:
            times[n].append(_timed(fns[n]))
    return {n: statistics.median(v) for n, v in times.items()}


def gemv_probe():
    """A large fp32 GEMV (1 x 576 by 576 x 9216, 30 distinct matrices, 637 MB) as (callable, bytes it reads): the
    rate at which this machine streams weights, the memory floor of a step."""
    import torch

    w = torch.randn(30, 576, 9216)
    x = torch.randn(1, 576)
    return (lambda: [x @ w[i] for i in range(30)]), w.numel() * 4


def gemm_probe():
    """A large fp32 matrix product (1024^3, MKL through torch) as (callable, FLOPs it does): the compute ceiling
    (what MKL reaches, below the FMA units' nominal rate)."""
    import torch

    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    return (lambda: a @ b), 2 * 1024 ** 3


def floor_bandwidth(reps: int) -> float:
    """Bytes per second of :func:`gemv_probe` (median of ``reps``)."""
    fn, nbytes = gemv_probe()
    return nbytes / _interleaved({"gemv": fn}, reps)["gemv"]


def peak_flops(reps: int) -> float:
    """FLOP per second of :func:`gemm_probe` (median of ``reps``)."""
    fn, flops = gemm_probe()
    return flops / _interleaved({"gemm": fn}, reps)["gemm"]
