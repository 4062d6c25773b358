"""``csrc/sampling.c``'s build and status: the nucleus selection and the inverse-CDF draw of
:mod:`triforce.speculation.sampling` (``TRIFORCE_SAMPLING_KERNEL=0`` turns it off)."""

from __future__ import annotations

from .cpu import _F, _I, _P, PORTABLE_CFLAGS, SAMPLING_CFLAGS, SAMPLING_ENV_SWITCH, _Library, best_build

#: the builds of csrc/sampling.c: its AVX2 compares and maxima, or its plain C branches (the same results)
_BUILDS = {"AVX2": (("avx2",), SAMPLING_CFLAGS), "portable": ((), PORTABLE_CFLAGS)}
_sampling = _Library("sampling.c", SAMPLING_ENV_SWITCH, (), lambda: best_build(_BUILDS), {
    "triforce_top_p": (_I, [_P, _I, _I, _F, _I, _P, _P]),
    "triforce_sample": (_I, [_P, _P, _P, _I, _I, _P])}, _BUILDS)


def sampling_kernel() -> dict | None:
    """The sampling kernel's functions by symbol (``triforce_top_p``, ``triforce_sample``), or None where it is off or
    unavailable (loads it on first use)."""
    return _sampling.load()


def sampling_status() -> str:
    """'on (...)', 'off (...)' or 'unavailable: <reason>' for the sampling kernel (loads it if nobody has yet)."""
    _sampling.load()
    return _sampling.status
