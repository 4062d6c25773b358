"""Building and loading our C kernels (``csrc/*.c``): each compiled once per machine with the system C compiler
(``cc``, ``$CC`` overrides), best build this CPU and compiler take first, kept in the triforce cache (or a per-user
temporary directory where that cannot be used), and loaded with ctypes on first use, feature detection with a
fallback (:class:`_Library`; the kernels themselves and their fallbacks are in ``kernels/cpu.py`` and beside their
callers)."""

from __future__ import annotations

import ctypes
import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

_CSRC = Path(__file__).with_name("csrc")
_lock = threading.Lock()
#: environment variable: "AVX2" builds and loads every kernel as on a CPU without AVX-512 (the flags that start with
#: "avx512" hidden from the choice of builds), so the AVX2 builds run, and are tested, on an AVX-512 machine
#: (tests/test_exactness.py); "portable" as on a CPU with neither AVX2 nor AVX-512 (those, FMA and F16C hidden too):
#: every kernel's plain C build, no ISA flags, what an older x86-64 CPU or aarch64 runs; unset or empty: this CPU's
#: own flags. Read when a kernel first loads.
ISA_ENV = "TRIFORCE_KERNEL_ISA"
#: the values :data:`ISA_ENV` takes
ISA_CHOICES = ("", "AVX2", "portable")
#: the flags "portable" hides: every SIMD extension a build of ours asks for beyond x86-64's baseline
_PORTABLE_HIDDEN = ("avx", "fma", "f16c")


def _cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where it cannot be read), less AVX-512's where
    :data:`ISA_ENV` is "AVX2", less every AVX flag, FMA and F16C where it is "portable".

    Raises:
        ValueError: :data:`ISA_ENV` set to something other than "AVX2", "portable" or "" (the message lists them).
    """
    isa = os.environ.get(ISA_ENV, "")
    if isa not in ISA_CHOICES:
        raise ValueError(f"{ISA_ENV} must be 'AVX2', 'portable' or unset, got {isa!r}")
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next((line.split(":", 1)[-1] for line in f if line.startswith("flags")), "").split())
    except OSError:
        return set()
    if isa == "portable":
        return {f for f in flags if not f.startswith(_PORTABLE_HIDDEN)}
    return {f for f in flags if not f.startswith("avx512")} if isa == "AVX2" else flags


def _build(out_dir: Path, source_path: Path, cflags: tuple[str, ...]) -> Path:
    """Compile ``source_path`` with ``cflags`` into ``out_dir`` and return the library's path; a build is kept per
    (source and the headers beside it, flags, compiler) hash, mode 0755 so that every user sharing the directory can
    load it.

    Concurrent first uses compile once: the compile runs under a file lock (``filelock``, beside the library), and the
    library appears by an atomic rename, so no process ever loads half a file.

    Raises:
        RuntimeError: no C compiler, or the compiler failed (its last lines of output).
        OSError: ``out_dir`` cannot be created or written.
    """
    from filelock import FileLock

    cc = shlex.split(os.environ.get("CC", "")) or [c for c in (shutil.which("cc") or shutil.which("gcc"),) if c]
    if not cc:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    source = source_path.read_bytes() + b"".join(h.read_bytes() for h in sorted(source_path.parent.glob("*.h")))
    key = hashlib.sha256(source + " ".join((*cc, *cflags)).encode()).hexdigest()[:16]
    lib = out_dir / f"{source_path.stem}-{key}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(lib) + ".lock", timeout=600, mode=0o666):
        if lib.exists():  # another process built it while this one waited
            return lib
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
        os.close(fd)
        try:
            run = subprocess.run([*cc, *cflags, "-o", tmp, str(source_path), "-lm"], capture_output=True, text=True,
                                 timeout=120)
            if run.returncode != 0:
                raise RuntimeError(f"{' '.join(cc)} failed: {run.stderr.strip()[-500:]}")
            os.chmod(tmp, 0o755)  # mkstemp's 0600: another user's dlopen would be refused
            os.replace(tmp, lib)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return lib


def kernel_dirs() -> list[Path]:
    """Where kernels are built, in order of preference: ``<triforce cache>/kernels`` (``defaults.cache_dir``), then a
    per-user directory under the system's temporary directory, used where the first cannot be written or holds a
    library this user cannot load."""
    from ..defaults import cache_dir

    user = os.getuid() if hasattr(os, "getuid") else os.environ.get("USERNAME", "user")
    return [cache_dir() / "kernels", Path(tempfile.gettempdir()) / f"triforce-kernels-{user}"]


def _load_built(source_path: Path, cflags: tuple[str, ...]) -> ctypes.CDLL:
    """The library of ``source_path`` built with ``cflags`` (:func:`_build`), from the first of :func:`kernel_dirs`
    where it can be built and loaded.

    Raises:
        RuntimeError: the compiler failed (the same in every directory: not retried).
        OSError: no directory could be written or loaded from (the last one's error).
    """
    error: OSError | None = None
    for directory in kernel_dirs():
        try:
            return ctypes.CDLL(str(_build(directory, source_path, cflags)))
        except OSError as e:  # unwritable, or another user's unreadable file: the next directory
            error = e
    raise error


class _Library:
    """One C file of ``csrc/``, built once per machine and loaded with ctypes on first use (feature detection with a
    fallback): ``load()`` gives its functions by name, or None with ``status`` saying why they are unavailable."""

    def __init__(self, source: str, switch: str, cpu_needs: tuple[str, ...], flags, symbols: dict,
                 builds: dict | None = None) -> None:
        self.source, self.switch, self.cpu_needs, self.flags, self.symbols = source, switch, cpu_needs, flags, symbols
        self.builds = builds  # name -> (CPU features, flags), best first: the next one this CPU runs is tried when
        # the compiler rejects a build's flags (an older compiler without -mavx512vnni, say)
        self.fns: dict | None = None
        self.status = "not loaded"
        self.one_row: bool | None = None  # the linear kernels' decode-step choice, set by f32_one_row_pays
        self.one_row_exact: bool | None = None  # the verifier's decode steps' one, set by f32_one_row_exact
        self.beats_onednn: bool | None = None  # and their multi-row one, set by f32_beats_onednn

    def load(self) -> dict | None:
        with _lock:
            if self.fns is not None or self.status != "not loaded":
                return self.fns
            if os.environ.get(self.switch, "1") == "0":
                self.status = f"off ({self.switch}=0)"
                return None
            if not set(self.cpu_needs) <= _cpu_flags():
                self.status = f"unavailable: the CPU has no {'/'.join(n.upper() for n in self.cpu_needs)}"
                return self._off()
            first = self.flags()
            candidates = [first] + [(cflags, name) for name, (needs, cflags) in (self.builds or {}).items()
                                    if set(needs) <= _cpu_flags() and cflags != first[0]]
            rejected = []
            for cflags, label in candidates:
                try:
                    lib = _load_built(_CSRC / self.source, cflags)
                    fns = {name: getattr(lib, name) for name in self.symbols}
                except RuntimeError as e:  # the compiler rejected these flags: the next build
                    rejected.append(f"the {label} build failed to compile: {e}")
                    continue
                except (OSError, subprocess.SubprocessError, AttributeError) as e:
                    self.status = f"unavailable: {e}"
                    return self._off()
                for name, (restype, argtypes) in self.symbols.items():
                    fns[name].restype, fns[name].argtypes = restype, argtypes
                fell_back = f"; {rejected[0]}" if rejected else ""
                self.fns, self.status = fns, f"on (csrc/{self.source}, {label}{fell_back})"
                return self.fns
            self.status = f"unavailable: {'; '.join(rejected)}"
            return self._off()

    def _off(self) -> None:
        """Name this kernel once on stderr (a RuntimeWarning) with :attr:`status`'s reason: PyTorch's ops run
        instead, slower, and the user should know why. Not called for a kernel switched off by its variable."""
        warnings.warn(f"triforce: csrc/{self.source} is off, PyTorch's ops run instead ({self.status}; "
                      f"{self.switch}=0 turns it off quietly)", RuntimeWarning, stacklevel=3)
        return None


def best_build(builds: dict) -> tuple[tuple[str, ...], str]:
    """(flags, name) of the first of ``builds`` (name -> (CPU features it needs, flags), best first) this CPU runs,
    else the last one (whose load then says what the CPU lacks). Raises nothing: ``_Library.load`` reports a CPU
    without the features."""
    isa = next((isa for isa, (needs, _) in builds.items() if set(needs) <= _cpu_flags()), list(builds)[-1])
    return builds[isa][1], isa


def forced_build(builds: dict, isa: str, source: str, switch: str, symbols: dict) -> "_Library":
    """The C file ``source`` built as ``builds[isa]`` whatever this CPU's best build, so that tests and benchmarks
    check and time its other paths (the AVX2 one on an AVX-512 machine).

    Raises:
        ValueError: an ``isa`` not in ``builds``.
    """
    if isa not in builds:
        raise ValueError(f"isa must be one of {sorted(builds)}, got {isa!r}")
    needs, cflags = builds[isa]
    return _Library(source, switch, needs, lambda: (cflags, isa), symbols)
