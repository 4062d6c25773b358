"""Continuous batching: the model forwards of concurrent generations, run together as one ragged forward.

Each generation runs its ordinary synchronous code (the tier chain of ``speculation/tiers.py``, the API's detokenizer
and stop strings) in its own greenlet. Where that code runs a model forward (:func:`run_forward`, called by
``ModelTier._forward``), the greenlet hands the forward to the :class:`BatchScheduler` and sleeps. When every
generation waits on a forward, the scheduler runs the waiting forwards of one model as a single ragged forward
(:meth:`~triforce.model.transformer.Transformer.forward_ragged`: the projections and MLPs once over every sequence's
rows, the attention of each sequence over its own caches) and wakes each generation with its own logits. This is
iteration-level scheduling (Orca, Yu et al., OSDI 2022) applied to every forward of a speculation hierarchy, so a
sequence in the middle of a draft block, one verifying and one prefilling a chunk of its prompt share forwards of
the same model: a long prefill runs chunk by chunk between the decode steps of running sequences (chunked
prefill, Sarathi, Agrawal et al., arXiv 2308.16369). Sequences join and leave between forwards.

Lossless per sequence: a sequence's caches, sampling parameters and random generator are its own, and its tier
code runs unchanged; a batched forward gives each row the logits it would get alone up to the rounding of the
matrix products (the same bound as a verification block against a decode step).

Which model runs next: the one with the most waiting forwards, unless a forward has waited :attr:`MAX_WAIT`
rounds, whose model then runs (no sequence starves behind a busier model). Which of its forwards: every short one
(decode steps, draft blocks, verifications: at most :data:`SHORT_FORWARD_ROWS` rows), and of the long ones
(prefill chunks) the earliest admitted, in order, up to :data:`PREFILL_ROWS_PER_FORWARD` rows (at least one), as
Sarathi's token budget: prompts are prefilled first come, first served, so the first to arrive starts streaming
while later prompts are still prefilled, instead of every prompt's first token waiting for all of them.

How long a prefill chunk is (:func:`prefill_chunk`): while other generations run, the chunk that shares their
forward is sized so that the forward takes about :data:`PREFILL_CHUNK_SECONDS`, from the seconds per prompt token of
the last forward that held a prefill chunk (the cost per token grows with the context the chunk attends to, and the
next chunk follows it), so the running streams' time between tokens stays bounded (Sarathi's stall-free batching);
alone, a generation prefills in its tier's chunks (512 tokens).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import greenlet
import torch

from ..kv.caches import KVCache

MAX_WAIT = 2  # rounds a forward may wait while other models' forwards run
#: rows of a forward that always joins its model's batch (decode steps, draft blocks, the verifier's blocks: past
#: 64 tokens they run in pieces of at most 64, ``exact.verify_forward``; longer forwards, prefill chunks and a lower
#: tier's blocks past gamma 63, are budgeted like prefill chunks)
SHORT_FORWARD_ROWS = 64
#: rows of longer forwards (prefill chunks) one batched forward takes, earliest admitted first (one at least):
#: one prefill chunk of the target (``ModelTier``'s ``prefill_chunk``, 512)
PREFILL_ROWS_PER_FORWARD = 512
#: seconds a prefill chunk's forward should take while other generations run (a running stream's gap between tokens
#: is about one such forward)
PREFILL_CHUNK_SECONDS = 0.25
#: ... but a chunk holds at least this many tokens
MIN_PREFILL_CHUNK = 32


@dataclass
class ForwardRequest:
    """One sequence's forward, waiting to be batched.

    Attributes:
        model: the :class:`~triforce.model.transformer.Transformer` to run.
        input_ids: (1, T) int64.
        positions: (T,) int64 absolute positions continuing ``cache``.
        cache: the sequence's cache for this model.
        num_logits: logits for the last ``num_logits`` positions (None: all T).
        waited: rounds this request has waited so far.
    """

    model: Any
    input_ids: torch.Tensor
    positions: torch.Tensor
    cache: KVCache
    num_logits: int | None
    waited: int = 0


def run_forward(model, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                num_logits: int | None = None) -> tuple[torch.Tensor, float]:
    """``model(input_ids, positions, cache, num_logits)``, batched with other sequences' forwards when called from a
    generation run by a :class:`BatchScheduler`; a direct call otherwise.

    Args and raises: as :meth:`~triforce.model.transformer.Transformer.forward` ((1, T) ids, (T,) positions).

    Returns:
        ``(logits, seconds)``: logits (1, num_logits or T, V) fp32, and the wall time in seconds of the forward that
        computed them. Batched, that is the whole batched forward (shared with the other sequences in it), never the
        time this generation waited for other forwards or other generations' code.
    """
    current = greenlet.getcurrent()
    if not isinstance(current, _SequenceGreenlet):
        t0 = time.perf_counter()
        logits = model(input_ids, positions, cache, num_logits=num_logits)
        return logits, time.perf_counter() - t0
    return current.parent.switch(ForwardRequest(model, input_ids, positions, cache, num_logits))


class _SequenceGreenlet(greenlet.greenlet):
    """A greenlet that runs one generation (marks the forwards :func:`run_forward` should batch); ``scheduler``: the
    :class:`BatchScheduler` running it."""

    scheduler: "BatchScheduler"


def prefill_chunk(default: int) -> int:
    """Prompt tokens the calling generation's next prefill forward should hold (module docstring).

    Args:
        default: the tier's chunk (``ModelTier.prefill_chunk``), what a generation running alone uses.

    Returns:
        ``default`` outside a :class:`BatchScheduler`, with no other generation running, or before the scheduler
        timed any prefill forward; else the tokens that take :data:`PREFILL_CHUNK_SECONDS` at the last timed prefill
        forward's seconds per token, between :data:`MIN_PREFILL_CHUNK` and ``default``.
    """
    current = greenlet.getcurrent()
    rate = current.scheduler.prefill_token_seconds if isinstance(current, _SequenceGreenlet) else None
    if rate is None or current.scheduler.running <= 1:
        return default
    return max(MIN_PREFILL_CHUNK, min(default, int(PREFILL_CHUNK_SECONDS / max(rate, 1e-9))))


def others_running() -> bool:
    """Whether the calling generation runs in a :class:`BatchScheduler` beside other generations: work of its own that
    is not a forward (:func:`run_forward`), such as timing a step (``Engine.step_times``), would stall their tokens."""
    current = greenlet.getcurrent()
    return isinstance(current, _SequenceGreenlet) and current.scheduler.running > 1


class Cancelled(Exception):
    """Raised inside a generation cancelled while it waited on a forward (:meth:`BatchedSequence.cancel`)."""


@dataclass
class BatchedSequence:
    """A generation run by a :class:`BatchScheduler`.

    Attributes:
        fn: the generation, a callable without arguments run in the scheduler's thread.
        result: what ``fn`` returned, once :attr:`done`.
        error: the exception ``fn`` raised (:class:`Cancelled` after :meth:`cancel`), once :attr:`done`.
        done: ``fn`` has returned or raised.
    """

    fn: Callable[[], Any]
    result: Any = None
    error: BaseException | None = None
    done: bool = False
    cancelled: bool = False
    _glet: _SequenceGreenlet | None = field(default=None, repr=False)
    _request: ForwardRequest | None = field(default=None, repr=False)

    def cancel(self) -> None:
        """Stop this generation at its next forward: :class:`Cancelled` is raised inside it there (its ``finally``
        blocks run), and its caches are freed with its frames. Thread-safe; no effect once done."""
        self.cancelled = True


class BatchScheduler:
    """Runs generations concurrently in one thread, batching their model forwards (module docstring).

    Args:
        max_batch: most generations running at once (>= 1); the rest wait in arrival order.

    Use: :meth:`submit` generations (from any thread), then call :meth:`step` (in one thread) until :meth:`idle`;
    or :meth:`run` to do both for a list of callables.

    Raises:
        ValueError: ``max_batch`` below 1.
    """

    def __init__(self, max_batch: int = 8) -> None:
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        self.max_batch = max_batch
        self._lock = threading.Lock()
        self._waiting: list[BatchedSequence] = []  # submitted, not started
        self._running: list[BatchedSequence] = []
        self.forwards = 0  # batched forwards run
        self.sequence_forwards = 0  # sequences' forwards they held (sequence_forwards / forwards = mean batch)
        self.prefill_token_seconds: float | None = None  # the last forward with a prefill chunk: seconds / its tokens

    # ---------------------------------------------------------------- queue
    def submit(self, fn: Callable[[], Any]) -> BatchedSequence:
        """Queue a generation; it starts at a later :meth:`step` when fewer than ``max_batch`` run."""
        seq = BatchedSequence(fn)
        with self._lock:
            self._waiting.append(seq)
        return seq

    @property
    def running(self) -> int:
        """Generations started and not done."""
        return len(self._running)

    @property
    def queued(self) -> int:
        """Generations submitted and not started."""
        return len(self._waiting)

    def idle(self) -> bool:
        """Nothing running or queued."""
        return not self._running and not self._waiting

    # ---------------------------------------------------------------- running
    def _resume(self, seq: BatchedSequence, value: Any = None, error: BaseException | None = None) -> None:
        """Run ``seq`` until its next forward (kept as its request) or its end."""
        try:
            if error is not None:
                out = seq._glet.throw(error)
            else:  # the first switch starts fn, without arguments
                out = seq._glet.switch() if value is None else seq._glet.switch(value)
        except BaseException as e:  # noqa: BLE001 - the generation's own error, reported on its sequence
            # a cancelled generation keeps no traceback: its frames (and caches) are freed now
            seq.error, seq.done = (Cancelled(str(e)) if isinstance(e, Cancelled) else e), True
        else:
            if seq._glet.dead:
                seq.result, seq.done = out, True
            elif isinstance(out, ForwardRequest):
                seq._request = out
                return
            else:  # switched to the scheduler with something else: that sequence's bug, not the batch's
                seq._glet.throw(greenlet.GreenletExit)
                seq.error, seq.done = TypeError(f"a batched generation switched to the scheduler with {out!r:.60}, "
                                                "not a forward (only run_forward may switch)"), True
        seq._request, seq._glet = None, None
        self._running.remove(seq)

    def _admit(self) -> None:
        while len(self._running) < self.max_batch:
            with self._lock:
                if not self._waiting:
                    return
                seq = self._waiting.pop(0)
            if seq.cancelled:
                seq.error, seq.done = Cancelled("cancelled before it started"), True
                continue
            seq._glet = _SequenceGreenlet(seq.fn)  # parent: the greenlet calling step()
            seq._glet.scheduler = self
            self._running.append(seq)
            self._resume(seq)

    def step(self) -> bool:
        """Start queued generations, cancel the cancelled, run one batched forward and wake its sequences.

        Returns:
            False when nothing is running or queued any more.
        """
        self._admit()
        for seq in [s for s in self._running if s.cancelled]:
            self._resume(seq, error=Cancelled("cancelled"))
        pending = [s for s in self._running if s._request is not None]
        if not pending:
            return not self.idle()
        group = self._choose(pending)
        for s in pending:  # rounds waited behind another model (not behind earlier prompts' prefill chunks)
            if s._request.model is not group[0]._request.model:
                s._request.waited += 1
        group = self._budget(group)
        requests = [s._request for s in group]
        for s in group:
            s._request = None
        model = requests[0].model
        t0 = time.perf_counter()
        try:
            outputs = model.forward_ragged([(r.input_ids, r.positions, r.cache, r.num_logits) for r in requests])
        except Exception:  # noqa: BLE001 - find whose forward fails: each runs alone, its error goes to it
            outputs = None
        seconds = time.perf_counter() - t0  # run_forward's second value: the batched forward's own time
        long_rows = sum(r.input_ids.shape[-1] for r in requests if r.input_ids.shape[-1] > SHORT_FORWARD_ROWS)
        if long_rows and outputs is not None:  # the next chunk's size follows (prefill_chunk)
            self.prefill_token_seconds = seconds / long_rows
        self.forwards += 1
        self.sequence_forwards += len(group)
        for i, (seq, req) in enumerate(zip(group, requests)):
            if outputs is not None:
                self._resume(seq, (outputs[i], seconds))
                continue
            try:
                t0 = time.perf_counter()
                out = model(req.input_ids, req.positions, req.cache, num_logits=req.num_logits)
            except Exception as e:  # noqa: BLE001
                self._resume(seq, error=e)
            else:
                self._resume(seq, (out, time.perf_counter() - t0))
        return not self.idle()

    @staticmethod
    def _choose(pending: list[BatchedSequence]) -> list[BatchedSequence]:
        """The sequences whose model runs next (module docstring: most waiting, unless one waited MAX_WAIT)."""
        groups: dict[int, list[BatchedSequence]] = {}
        for s in pending:
            groups.setdefault(id(s._request.model), []).append(s)
        starved = [s for s in pending if s._request.waited >= MAX_WAIT]
        if starved:
            return groups[id(starved[0]._request.model)]
        return max(groups.values(), key=len)  # ties: the first model to ask

    @staticmethod
    def _budget(group: list[BatchedSequence]) -> list[BatchedSequence]:
        """Of one model's waiting forwards (in admission order), the short ones and the earliest long ones up to
        :data:`PREFILL_ROWS_PER_FORWARD` rows (module docstring)."""
        chosen, rows = [], 0
        for s in group:
            t = s._request.input_ids.shape[-1]
            if t <= SHORT_FORWARD_ROWS:
                chosen.append(s)
            elif rows == 0 or rows + t <= PREFILL_ROWS_PER_FORWARD:
                chosen.append(s)
                rows += t
        return chosen

    def interrupt(self) -> None:
        """Ctrl-C: raise KeyboardInterrupt inside every running generation (each ends as its code handles it, e.g.
        ``TriForce.stream`` with ``finish_reason`` ``interrupted``) and drop the queued ones (:class:`Cancelled`)."""
        for seq in list(self._running):
            seq._request = None
            self._resume(seq, error=KeyboardInterrupt())
        with self._lock:
            queued, self._waiting = self._waiting, []
        for seq in queued:
            seq.error, seq.done = Cancelled("interrupted before it started"), True

    def run(self, fns: list[Callable[[], Any]]) -> list[BatchedSequence]:
        """Run every callable to its end, ``max_batch`` at a time; returns their sequences, in order (check
        :attr:`BatchedSequence.error`)."""
        seqs = [self.submit(fn) for fn in fns]
        while self.step():
            pass
        return seqs
