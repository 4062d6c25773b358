"""Memory accounting: refuse a request before allocating what does not fit."""

from __future__ import annotations

import resource
import sys

import psutil
import torch


class InsufficientMemoryError(MemoryError):
    """A model or a request needs more memory than the device has free; the message gives both figures."""


def available_bytes(device: torch.device | str) -> int:
    """Free memory on ``device`` in bytes: ``torch.cuda.mem_get_info`` on CUDA, psutil's ``available`` otherwise."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return int(psutil.virtual_memory().available)


def fmt_bytes(n: float) -> str:
    """``1.5 GiB`` style rendering of a byte count."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def check_fits(needed: dict[str, int], device: torch.device | str, what: str, already: dict[str, int] | None = None,
               headroom: float = 0.05) -> None:
    """Raise if ``sum(needed)`` bytes plus a small headroom exceed the free memory of ``device``.

    Args:
        needed: bytes about to be allocated, by part (e.g. ``{"full KV cache": ..., "draft cache": ...}``).
        device: where they go.
        what: what is being allocated, for the message (``"this request"``, ``"model weights"``).
        already: bytes already resident, by part, reported in the message (weights).
        headroom: fraction of the free memory kept for activations and the allocator.

    Raises:
        InsufficientMemoryError: with the needed bytes (by part), what is already used, and what is free.
    """
    total = sum(needed.values())
    free = available_bytes(device)
    if total > free * (1 - headroom):
        parts = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in needed.items())
        resident = ""
        if already:
            resident = " beside " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in already.items()) + " already loaded"
        raise InsufficientMemoryError(
            f"{what} needs {fmt_bytes(total)} ({parts}){resident}, but only {fmt_bytes(free)} is free on "
            f"{torch.device(device)}; use a shorter prompt, fewer --max-new-tokens, a smaller --budget, or --dtype bfloat16"
        )


def peak_memory_bytes(device: torch.device | str) -> int:
    """Peak memory of this process: max allocated bytes on CUDA, peak resident set size on the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)
