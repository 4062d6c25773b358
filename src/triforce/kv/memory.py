"""Memory accounting: refuse a request before allocating what does not fit; plan KV-cache offloading."""

from __future__ import annotations

import resource
import sys
from dataclasses import asdict, dataclass

import psutil
import torch

from ..errors import NamesParameters


class InsufficientMemoryError(NamesParameters, MemoryError):
    """A model or a request needs more memory than the device has free; the message gives both figures and the
    parameters that would lower the need (spelled as the caller spells them, :mod:`triforce.errors`)."""


def available_bytes(device: torch.device | str) -> int:
    """Free memory on ``device`` in bytes: ``torch.cuda.mem_get_info`` on CUDA, psutil's ``available`` otherwise."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return int(psutil.virtual_memory().available)


_LIBC: list = []  # [the C library, or None where it has no malloc_trim], loaded on first use


def release_free_memory() -> bool:
    """Return the C heap's free pages to the operating system (glibc's ``malloc_trim(0)``); False where the C
    library has none (macOS, musl).

    Why: a KV cache of a few hundred tokens is a few MB per tensor, under glibc's mmap threshold (dynamic, up to
    32 MiB), so it lives in the heap, and after requests of mixed lengths come and go the heap keeps their freed
    pages until this runs. The server calls it when a request ends.
    """
    if not _LIBC:
        import ctypes
        import ctypes.util

        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.append(libc if hasattr(libc, "malloc_trim") else None)
        except OSError:
            _LIBC.append(None)
    if _LIBC[0] is None:
        return False
    _LIBC[0].malloc_trim(0)
    return True


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
            f"{torch.device(device)}; use a shorter prompt, fewer `max_new_tokens`, a smaller `budget` or "
            f"`gamma1`/`gamma2`, or `dtype` bfloat16"
        )


def peak_memory_bytes(device: torch.device | str) -> int:
    """Peak memory of this process: max allocated bytes on CUDA, peak resident set size on the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


@dataclass(frozen=True)
class KVPlacement:
    """Where the layers of a full KV cache live under offloading (see :class:`~triforce.kv.caches.FullKVCache`).

    Attributes:
        layers: L, the model's layers.
        on_chip_layers: leading layers kept on the device; the other ``L - on_chip_layers`` are streamed from host
            memory, one layer ahead of the compute.
        device: the compute device.
        device_bytes: bytes on the device: the on-chip layers plus the two stream buffers (one layer each).
        host_bytes: bytes in (pinned) host memory: every layer.
        free_device_bytes: free device memory the plan was made from (None when ``on_chip_layers`` was given).
    """

    layers: int
    on_chip_layers: int
    device: str
    device_bytes: int
    host_bytes: int
    free_device_bytes: int | None = None

    def summary(self) -> str:
        """One line for start-up: how many layers sit where, and the bytes."""
        free = self.free_device_bytes
        how = "chosen from " + fmt_bytes(free) + " free" if free is not None else "as given"
        return (f"full KV cache offloaded: {self.on_chip_layers} of {self.layers} layers on {self.device} "
                f"({fmt_bytes(self.device_bytes)} with stream buffers), {self.layers - self.on_chip_layers} streamed "
                f"from host memory ({fmt_bytes(self.host_bytes)}) with one-layer prefetch; {how}")

    def to_dict(self) -> dict:
        """JSON-ready fields."""
        return asdict(self)


def place_kv(layers: int, layer_bytes: int, device: torch.device | str, reserved_bytes: int = 0,
             on_chip_layers: int | None = None, headroom: float = 0.1) -> KVPlacement:
    """Choose how many layers of an offloaded full KV cache stay on the device (the memory planner).

    The largest ``n`` with ``n * layer_bytes + buffers + reserved_bytes <= (1 - headroom) * free`` where ``free`` is
    the device's free memory (:func:`available_bytes`, taken after the weights are loaded) and ``buffers`` are the
    two one-layer stream buffers (none when every layer fits).

    Args:
        layers: L.
        layer_bytes: keys + values of one layer at the cache's capacity, bytes.
        device: compute device.
        reserved_bytes: other device allocations still to come (retrieval and draft caches), bytes.
        on_chip_layers: fixed by the user (``--on-chip-layers``): checked, not chosen.
        headroom: fraction of free memory left for activations and the allocator.

    Raises:
        ValueError: ``on_chip_layers`` outside [0, layers].
        InsufficientMemoryError: not even the two stream buffers fit on the device.
    """
    device = torch.device(device)
    free = None
    if on_chip_layers is None:
        free = available_bytes(device)
        budget = int(free * (1 - headroom)) - reserved_bytes
        if budget >= layers * layer_bytes:
            n = layers
        else:
            n = max(0, (budget - 2 * layer_bytes) // layer_bytes)
            if budget < 2 * layer_bytes:
                raise InsufficientMemoryError(
                    f"offloading needs two one-layer stream buffers ({fmt_bytes(2 * layer_bytes)}) on {device} beside "
                    f"{fmt_bytes(reserved_bytes)} of other caches, but only {fmt_bytes(free)} is free")
        on_chip_layers = int(min(n, layers))
    elif isinstance(on_chip_layers, bool) or not isinstance(on_chip_layers, int) or not 0 <= on_chip_layers <= layers:
        raise ValueError(f"on_chip_layers must be an integer in [0, {layers}], got {on_chip_layers!r}")
    buffers = min(2, layers - on_chip_layers) * layer_bytes
    return KVPlacement(layers=layers, on_chip_layers=on_chip_layers, device=str(device),
                       device_bytes=on_chip_layers * layer_bytes + buffers, host_bytes=layers * layer_bytes,
                       free_device_bytes=free)
