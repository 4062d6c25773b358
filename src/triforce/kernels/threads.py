"""CPU threads: OpenMP's wait policy and the number of threads torch uses.

torch's CPU kernels run on OpenMP (libgomp in the PyPI wheels). By default a libgomp thread that reaches the end of
a parallel region spins for about 3 ms (``GOMP_SPINCOUNT`` 300,000) before it sleeps. When another program keeps a
core busy, the spinning threads steal that core's time from the thread that still has work, and every parallel
region waits for its slowest thread. With ``OMP_WAIT_POLICY=PASSIVE`` an idle thread sleeps at once, but then every
one of the hundreds of small parallel regions of a decode step pays a wake-up, slower than one thread on an idle
machine. So triforce sets a short spin instead, ``GOMP_SPINCOUNT`` 10,000 (about 0.1 ms): as fast as the default on
an idle machine while a waiting thread gives its core back sooner (docs/usage.md, "Tuning"). libgomp reads the
variable once, when torch loads it, so :func:`configure_openmp` must run before ``import torch``: ``import
triforce`` does it first thing, which covers the ``triforce`` command and Python programs that import triforce
before torch.

Even so, a thread on a core another program keeps busy holds up every parallel region, so the default thread count
(``--threads`` not given, ``TriForce.load(threads="auto")``) counts the cores other programs leave idle while the
model loads (:class:`IdleCPUProbe`): one thread per idle physical core, at least one (docs/usage.md, "Tuning").
"""

from __future__ import annotations

import os
import sys
import time

#: environment variables that set OpenMP's waiting behaviour; when the user set any of them, triforce leaves it alone
WAIT_POLICY_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


#: libgomp spin count triforce sets (iterations a waiting OpenMP thread spins before it sleeps; libgomp's default
#: 300,000)
SPIN_COUNT = "10000"


def configure_openmp() -> bool:
    """Set ``GOMP_SPINCOUNT`` to :data:`SPIN_COUNT` for this process unless it is too late or the user chose.

    Returns:
        True when the variable was set now; False when torch is already imported (OpenMP has read its settings) or
        one of :data:`WAIT_POLICY_VARS` is set in the environment.
    """
    if "torch" in sys.modules or any(v in os.environ for v in WAIT_POLICY_VARS):
        return False
    os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
    return True


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask, e.g. under ``taskset`` or a container's cpuset), >= 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not on Linux
        return max(1, os.cpu_count() or 1)


class IdleCPUProbe:
    """How many of this process's CPUs other programs leave idle, measured from creation to :meth:`idle_cpus`.

    Busy time of the CPUs in the affinity mask (``/proc/stat`` through psutil) minus this process's own CPU time (all
    its threads and finished children), over the wall time between the two readings: the window is typically the
    model's loading, so the measurement costs nothing.
    """

    def __init__(self) -> None:
        self.cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        self.t0, self.busy0, self.own0 = time.monotonic(), self._busy(), self._own()

    def _busy(self) -> float:
        import psutil

        per_cpu = psutil.cpu_times(percpu=True)
        mine = [per_cpu[i] for i in self.cpus if i < len(per_cpu)] if self.cpus else per_cpu
        return sum(sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "steal", 0.0) - getattr(t, "guest", 0.0)
                   - getattr(t, "guest_nice", 0.0) for t in mine)

    @staticmethod
    def _own() -> float:
        import psutil

        t = psutil.Process().cpu_times()
        return t.user + t.system + t.children_user + t.children_system

    def idle_cpus(self, min_window: float = 0.3) -> float:
        """CPUs (of the affinity mask) other programs left idle since creation, in [0, available_cpus()]; waits
        until at least ``min_window`` seconds have passed (the kernel counts CPU time in 10 ms ticks)."""
        wait = min_window - (time.monotonic() - self.t0)
        if wait > 0:
            time.sleep(wait)
        wall = time.monotonic() - self.t0
        others = (self._busy() - self.busy0) - (self._own() - self.own0)
        n = available_cpus()
        return min(float(n), max(0.0, n - others / wall))


def default_threads(idle_cpus: float | None = None) -> int:
    """triforce's default thread count: one per physical core this process may use, or, given ``idle_cpus`` (from
    :class:`IdleCPUProbe`), one per core other programs leave at least 3/4 idle, at least 1.

    Hyper-threads share a core's arithmetic units, so a second thread per core adds synchronisation and no speed to
    these memory-bound kernels; a thread on a core another program keeps busy makes every parallel region wait for
    it (docs/history.md, "Threads on a shared machine").
    """
    try:
        import psutil

        physical = psutil.cpu_count(logical=False) or available_cpus()
    except ImportError:  # pragma: no cover - psutil is a dependency
        physical = available_cpus()
    n = min(physical, available_cpus())
    if idle_cpus is not None:
        n = min(n, int(idle_cpus + 0.25))
    return max(1, n)


def max_threads() -> int:
    """The largest accepted thread count: 4x this machine's CPUs."""
    return 4 * (os.cpu_count() or 1)


def check_threads(threads: object) -> None:
    """Raise ValueError (naming ``threads``) unless ``threads`` is None, ``"auto"`` or an integer in
    [1, :func:`max_threads`]."""
    if threads is None or threads == "auto":
        return
    limit = max_threads()
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= limit:
        raise ValueError(f"threads must be an integer between 1 and {limit} (4x this machine's {os.cpu_count()} CPUs) "
                         f"or 'auto', got {threads!r}")


def set_threads(threads: int | None) -> int:
    """Set torch's intra-op thread count; returns the count in use.

    Args:
        threads: 1..:func:`max_threads`, or None for :func:`default_threads` (without a load measurement).

    Raises:
        ValueError: ``threads`` is not an integer in [1, max_threads()] (message names ``threads``).
    """
    if threads == "auto":
        raise ValueError("threads must be an integer here; 'auto' needs a load measurement (IdleCPUProbe)")
    check_threads(threads)
    if threads is None:
        threads = default_threads()
    import torch

    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads
