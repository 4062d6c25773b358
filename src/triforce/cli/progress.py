"""Prefill progress for the command line, and keeping stdout for the ``--json`` object alone."""

from __future__ import annotations

import contextlib
import os
import sys
import time


class LineProgress:
    """Prefill progress as plain lines, for a stderr that is not a terminal (a log file, a pipe).

    Silent for the first ``delay`` seconds, then one line every ``every`` seconds, e.g.
    ``triforce: prefill 2,048/8,000 tokens (26%), 12 s, about 35 s left``, and a last line when it ends.
    Call it with the tokens each prefill chunk processed (the :meth:`~triforce.api.TriForce.stream`
    ``prefill_progress`` callback); :meth:`close` writes the last line (if any was written).

    Args:
        total: prompt tokens to process.
        stream: where lines go (stderr).
        delay, every: seconds.
    """

    def __init__(self, total: int, stream=None, delay: float = 2.0, every: float = 10.0) -> None:
        self.total, self.stream, self.delay, self.every = total, stream or sys.stderr, delay, every
        self.done, self.t0, self.last, self.closed = 0, time.monotonic(), None, False

    def _line(self, now: float, final: bool = False) -> None:
        elapsed = now - self.t0
        pct = 100 * self.done / self.total if self.total else 100.0
        left = "" if final or not self.done else f", about {elapsed * (self.total - self.done) / self.done:.0f} s left"
        print(f"triforce: prefill {self.done:,}/{self.total:,} tokens ({pct:.0f}%), {elapsed:.0f} s{left}",
              file=self.stream, flush=True)
        self.last = now

    def update(self, n: int) -> None:
        """``n`` more prompt tokens processed: write a line when one is due."""
        self.done += n
        now = time.monotonic()
        if now - self.t0 >= self.delay and (self.last is None or now - self.last >= self.every):
            self._line(now)

    __call__ = update

    def close(self) -> None:
        """Write the final line if progress lines were written; idempotent."""
        if not self.closed and self.last is not None:
            self._line(time.monotonic(), final=True)
        self.closed = True


def prefill_progress(total: int, disable: bool = False):
    """The CLI's prefill progress: a tqdm bar on a terminal (shown after 2 s), :class:`LineProgress` otherwise.

    Returns:
        an object with ``update(n)`` (tokens processed) and ``close()``.
    """
    if disable:
        return _NoProgress()
    if sys.stderr.isatty():
        from tqdm import tqdm

        return tqdm(total=total, unit="tok", desc="prefill", file=sys.stderr, leave=False, delay=2.0)
    return LineProgress(total)


class _NoProgress:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


@contextlib.contextmanager
def stdout_to_stderr():
    """Send everything written to stdout meanwhile to stderr: Python prints, C libraries and child processes
    (pip fetching the default model), so that ``--json`` leaves exactly one JSON object on stdout."""
    real = sys.stdout
    real.flush()
    try:
        saved = os.dup(1)  # the process's stdout, whatever sys.stdout is
    except OSError:  # fd 1 closed: Python-level only
        saved = None
    try:
        if saved is not None:
            os.dup2(2, 1)
        sys.stdout = sys.stderr
        yield
    finally:
        sys.stdout.flush()
        sys.stdout = real
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)
