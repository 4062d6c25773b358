"""CPU threads: OpenMP's wait policy and the number of threads torch uses.

torch's CPU kernels run on OpenMP (libgomp in the PyPI wheels). By default a libgomp thread that reaches the end of
a parallel region spins for about 3 ms (``GOMP_SPINCOUNT`` 300,000) before it sleeps. When another program keeps a
core busy, the spinning threads steal that core's time from the thread that still has work, and every parallel
region waits for its slowest thread: decoding at 2 threads next to one CPU-bound process ran 4x slower than at
1 thread (issue 16). With ``OMP_WAIT_POLICY=PASSIVE`` an idle thread sleeps at once, so a busy core costs at most
its share of the work. libgomp reads the variable once, when torch loads it, so :func:`configure_openmp` must run
before ``import torch``: ``import triforce`` does it first thing, which covers the ``triforce`` command and Python
programs that import triforce before torch. Measurements: docs/benchmarks.md, "Threads on a shared machine"
(``bench/threads.py``).
"""

from __future__ import annotations

import os
import sys

#: environment variables that set OpenMP's waiting behaviour; when the user set any of them, triforce leaves it alone
WAIT_POLICY_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def configure_openmp() -> bool:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` for this process unless it is too late or the user chose.

    Returns:
        True when the variable was set now; False when torch is already imported (OpenMP has read its settings) or
        one of :data:`WAIT_POLICY_VARS` is set in the environment.
    """
    if "torch" in sys.modules or any(v in os.environ for v in WAIT_POLICY_VARS):
        return False
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return True


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask, e.g. under ``taskset`` or a container's cpuset), >= 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not on Linux
        return max(1, os.cpu_count() or 1)


def default_threads() -> int:
    """triforce's default thread count: one per physical core this process may use.

    ``min(physical cores, CPUs in the affinity mask)``: hyper-threads share a core's arithmetic units, so a second
    thread per core adds synchronisation and no speed to these memory-bound kernels.
    """
    try:
        import psutil

        physical = psutil.cpu_count(logical=False) or available_cpus()
    except ImportError:  # pragma: no cover - psutil is a dependency
        physical = available_cpus()
    return max(1, min(physical, available_cpus()))


def max_threads() -> int:
    """The largest accepted thread count: 4x this machine's CPUs."""
    return 4 * (os.cpu_count() or 1)


def set_threads(threads: int | None) -> int:
    """Set torch's intra-op thread count; returns the count in use.

    Args:
        threads: 1..:func:`max_threads`, or None for :func:`default_threads`.

    Raises:
        ValueError: ``threads`` is not an integer in [1, max_threads()] (message names ``threads``).
    """
    limit = max_threads()
    if threads is None:
        threads = default_threads()
    elif isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= limit:
        raise ValueError(f"threads must be an integer between 1 and {limit} (4x this machine's {os.cpu_count()} CPUs), "
                         f"got {threads!r}")
    import torch

    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads
