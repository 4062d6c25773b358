"""Our CPU attention kernel for the verifier's full KV cache, built on first use, with PyTorch's SDPA as fallback.

A decode step of the verifier attends g query rows per KV head (grouped-query attention, g = nh / nkv) over the
whole cache: at 8K tokens the keys and values of SmolLM2 are 369 MB a step, read by PyTorch's CPU SDPA at about
6 GB/s on one core and parallelised over the 3 KV heads only. ``csrc/attention.c`` streams each key and value row
once for all rows of its head, split into key chunks that every thread shares (flash-decoding), and merges the
chunks with the log-sum-exp rule (see the C file's header for the equations and sources). Measured by
``bench/attention_kernel.py`` (docs/benchmarks.md, "Attention kernel").

The kernel is C with AVX2/FMA intrinsics and OpenMP, compiled once per machine with the system C compiler
(``cc``, ``$CC`` overrides) into ``<triforce cache>/kernels/``; the library links the ``libgomp`` torch already
loaded, so both share one OpenMP thread pool. Feature detection with a fallback: where there is no compiler, no
AVX2/FMA, the build fails, or ``TRIFORCE_ATTENTION_KERNEL=0`` is set, :func:`gqa_attention_kernel` returns None and
the caller uses SDPA (``status()`` says which and why).
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

#: environment variable: "0" turns the kernel off (SDPA everywhere)
ENV_SWITCH = "TRIFORCE_ATTENTION_KERNEL"
#: compiler flags; the build is cached per (source, flags, compiler) hash
CFLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC")
#: largest head_dim the kernel handles (checked in the C file)
MAX_HEAD_DIM = 256
#: keys per work item, whatever the block: the same chunks for a decode step and a verification block, so a query
#: row's result does not depend on the rows beside it (each thread's scores of a chunk: rows * CHUNK floats)
CHUNK = 256
_SOURCE = Path(__file__).with_name("csrc") / "attention.c"

_lock = threading.Lock()
_fn = None  # the ctypes function once loaded
_status = "not loaded"


def _cpu_has_avx2_fma() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx2" in flags and "fma" in flags


def _build(out_dir: Path) -> Path:
    """Compile ``csrc/attention.c`` into ``out_dir`` (atomic rename, so concurrent builders never see half a file)."""
    cc = shlex.split(os.environ.get("CC", "")) or [c for c in (shutil.which("cc") or shutil.which("gcc"),) if c]
    if not cc:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join((*cc, *CFLAGS)).encode()).hexdigest()[:16]
    lib = out_dir / f"attention-{key}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        run = subprocess.run([*cc, *CFLAGS, "-o", tmp, str(_SOURCE), "-lm"], capture_output=True, text=True, timeout=120)
        if run.returncode != 0:
            raise RuntimeError(f"{' '.join(cc)} failed: {run.stderr.strip()[-500:]}")
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def _load():
    """Build (once per machine) and load the kernel; None with ``_status`` saying why where it is unavailable."""
    global _fn, _status
    with _lock:
        if _fn is not None or _status != "not loaded":
            return _fn
        if os.environ.get(ENV_SWITCH, "1") == "0":
            _status = f"off ({ENV_SWITCH}=0)"
            return None
        if not _cpu_has_avx2_fma():
            _status = "unavailable: the CPU has no AVX2/FMA"
            return None
        try:
            from .download import cache_dir

            lib = ctypes.CDLL(str(_build(cache_dir() / "kernels")))
            fn = lib.triforce_gqa_attention
        except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as e:
            _status = f"unavailable: {e}"
            return None
        fn.restype = ctypes.c_int
        fn.argtypes = ([ctypes.c_void_p] * 5 + [ctypes.c_int] * 5 + [ctypes.c_int64] * 2 + [ctypes.c_int] * 2
                       + [ctypes.c_float, ctypes.c_int])
        _fn, _status = fn, "on (csrc/attention.c, AVX2)"
        return _fn


def status() -> str:
    """'on (...)', 'off (...)' or 'unavailable: <reason>' (loads the kernel if nobody has yet)."""
    _load()
    return _status


def gqa_attention_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_keys: int) -> torch.Tensor | None:
    """Causal GQA attention of a block of T queries that ends the sequence, over keys [0, n_keys), or None.

    The attention of :func:`triforce.caches.gqa_attention` with the full KV cache's mask (query i of the block, at
    position n_keys - T + i, sees keys j <= n_keys - T + i), computed by ``csrc/attention.c`` (split-key
    flash-decoding; module docstring). Softmax with our AVX2 ``expf`` (relative error < 2e-7); outputs agree with
    SDPA's to about 1e-6 relative.

    Args:
        q: (B, nh, T, hs) fp32 queries (after RoPE).
        k, v: (B, nkv, capacity, hs) fp32 views of one layer's cache whose last dim is contiguous, capacity >= n_keys.
        n_keys: keys the block sees, the cache length after this block's tokens were written.

    Returns:
        (B, nh, T, hs) fp32, or None when the kernel does not apply (not CPU/fp32, hs not a multiple of 8 or over
        :data:`MAX_HEAD_DIM`, shapes that do not match, nh not a multiple of nkv, or the kernel unavailable): the caller
        then uses SDPA, which raises on bad shapes.
    """
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        return None
    b, nh, t, hs = q.shape
    nkv = k.shape[1]
    if (q.device.type != "cpu" or q.dtype != torch.float32 or k.dtype != torch.float32 or v.dtype != torch.float32
            or k.shape[0] != b or k.shape[3] != hs or nkv < 1 or nh % nkv or t < 1
            or hs % 8 or hs > MAX_HEAD_DIM or k.stride(-1) != 1 or v.stride() != k.stride() or k.stride(2) != hs
            or n_keys < t or n_keys > k.shape[2]):
        return None
    rows = nh // nkv * t  # (g * T) query rows per KV head
    chunk = CHUNK
    fn = _load()
    if fn is None:
        return None
    q = q.contiguous()  # (B, nh, T, hs) == (B, nkv, g*T, hs): head h = kv * g + j, rows ordered (j, token)
    out = torch.empty_like(q)
    threads = torch.get_num_threads()
    # the chunks' partial results, then each thread's scores (csrc/attention.c)
    scratch = torch.empty(b * nkv * -(-n_keys // chunk) * rows * (hs + 2) + threads * rows * chunk, dtype=torch.float32)
    rc = fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), scratch.data_ptr(), b, nkv, rows, t, hs,
            k.stride(0), k.stride(1), n_keys, chunk, 1.0 / math.sqrt(hs), threads)
    return out if rc == 0 else None
