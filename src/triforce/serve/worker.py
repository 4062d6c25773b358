"""``triforce serve``: the one thread that runs the engine: queued requests in arrival order, batched."""

from __future__ import annotations

import asyncio
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..text.detok import IncrementalDetokenizer
from ..text.tokens import common_prefix_length
from .logprob_fields import describe
from .metrics import ServerMetrics
from .schema import GenerationRequest
from .settings import APIError, _invalid

if TYPE_CHECKING:  # pragma: no cover
    from ..api import TriForce
    from ..speculation.hierarchy import SpeculationConfig


# ---------------------------------------------------------------------------------------------------- worker
class _Abort(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class _Job:
    """One choice of a request. The choices of one request (``n``) share ``events``, each event tagged with its
    ``index``; the first carries the others as ``followers``, queued once it has prefilled the prompt."""

    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    received: float  # time.monotonic() at arrival
    deadline: float
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    index: int = 0  # the choice's index
    followers: list["_Job"] = field(default_factory=list)  # the request's other choices (first choice only)
    shared_prefix: tuple | None = None  # (FullKVCache, tokens): the prompt's KV the first choice computed

    def post(self, *item: Any) -> None:
        """Send ``(index, item)`` to the request's coroutine."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (self.index, item))
        except RuntimeError:  # the event loop is closed (shutdown)
            pass


#: most idle engine states kept for prefix reuse (bounds the prefix scan when their caches are small)
MAX_KEPT_ENGINES = 64


class GenerationWorker:
    """Runs queued generations on a single thread, up to ``max_batch`` at once with their forwards batched.

    Concurrent requests decode together (continuous batching, :class:`~triforce.model.batching.BatchScheduler`): a
    request joins the running batch between forwards, a long prompt's prefill runs chunk by chunk between the
    running requests' decode steps, and a finished or disconnected request leaves at once. Each running request
    has its own engine state (:meth:`~triforce.api.TriForce.fork`); the idle ones keep their last request's KV
    cache (the prefix cache), so a new request reuses the cache of whichever earlier request shares its longest
    prefix. The prefix cache is bounded by bytes: past ``prefix_cache_bytes`` the least recently used caches are
    dropped (the most recent one is always kept, so a chat's next turn reuses it), at most
    :data:`MAX_KEPT_ENGINES` idle engines are kept, and every kept cache is dropped when a request would not fit
    in memory otherwise.

    Each job receives, through its asyncio queue: ``("started", queue_seconds)`` when the engine takes it,
    ``("token", TokenEvent)`` per accepted token, then ``("done", info)`` or ``("error", APIError)``; a job
    cancelled before it started gets ``("cancelled",)``. Each event comes as ``(choice index, event)``.

    Several choices of one prompt (``n``): the first runs as any request; once it has its first token (its prefill
    done), a copy of the prompt's KV is made and the other choices are queued on the scheduler, each adopting that
    copy as its prefix (:meth:`~triforce.engine.Engine.adopt_prefix`), so they feed only the prompt's last token and
    decode in the same batch. Where no copy can be made (the first choice ended before a token, an offloaded cache)
    they prefill the prompt themselves.

    Args:
        tf: the model; only this thread calls its engine.
        queue_size: most jobs waiting (not counting the running ones); :meth:`submit` refuses beyond.
        metrics: counters and gauges to update.
        spec: speculation settings for every request.
        max_batch: most requests running at once (1: one at a time in arrival order; models whose requests cannot
            share a forward, :meth:`~triforce.engine.Engine.fork`, run one at a time whatever the setting).
        prefix_cache_bytes: bytes of KV cache the idle engines may keep for prefix reuse, in all (the most recent
            request's cache is kept even when larger); None: no bound.
    """

    def __init__(self, tf: "TriForce", queue_size: int, metrics: ServerMetrics, spec: "SpeculationConfig",
                 max_batch: int = 1, prefix_cache_bytes: int | None = None) -> None:
        self.tf, self.queue_size, self.metrics, self.spec = tf, queue_size, metrics, spec
        self.prefix_cache_bytes = prefix_cache_bytes
        self._can_fork = True
        try:
            tf.fork()
        except ValueError:
            max_batch, self._can_fork = 1, False  # tensor parallelism or dynamic NTK: one request at a time
        self.max_batch = max_batch
        self._jobs: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._waiting = 0
        self._thread: threading.Thread | None = None
        self._active: dict[int, _Job] = {}  # id(job) -> job, the running ones
        self._idle_views: list = [] if self._can_fork else [tf]  # engines kept with their last cache, LRU first
        self._scheduler = None  # the BatchScheduler of the engine thread (_run)
        self._mean_seconds = 1.0  # running mean of a job's engine time, for Retry-After

    @property
    def waiting(self) -> int:
        """Jobs queued and not yet started."""
        return self._waiting

    @property
    def running(self) -> int:
        """Jobs running."""
        return len(self._active)

    @property
    def busy(self) -> bool:
        """Whether a job is running."""
        return bool(self._active)

    def retry_after(self) -> int:
        """Seconds a refused client should wait: the expected time to drain the queue (1 to 3600)."""
        rounds = (self._waiting + self.max_batch) / self.max_batch
        return int(min(3600, max(1, math.ceil(self._mean_seconds * rounds))))

    def submit(self, job: _Job) -> bool:
        """Queue a job and its followers; False when the queue cannot hold them all."""
        with self._lock:
            if self._waiting + 1 + len(job.followers) > self.queue_size:
                return False
            self._waiting += 1 + len(job.followers)
            self.metrics.queue_depth.set(self._waiting)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="triforce-engine", daemon=True)
                self._thread.start()
        self._jobs.put(job)
        return True

    def stop(self) -> None:
        """Cancel the running jobs and end the thread after them (jobs still queued are cancelled)."""
        with self._lock:
            active = list(self._active.values())
        for job in active:
            job.cancel.set()
        self._jobs.put(None)

    def _run(self) -> None:
        from ..model.batching import BatchScheduler

        scheduler = self._scheduler = BatchScheduler(self.max_batch)
        stopping = False
        while True:
            try:  # wait for work only when nothing runs
                job = self._jobs.get(block=scheduler.idle() and not stopping)
            except queue.Empty:
                job = False
            while job is not False:
                if job is None:
                    stopping = True
                elif stopping:
                    for one in (job, *job.followers):
                        self._dequeued()
                        one.post("cancelled")
                else:
                    scheduler.submit(lambda job=job: self._run_job(job))
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    job = False
            if stopping:
                with self._lock:
                    active = list(self._active.values())
                for job in active:
                    job.cancel.set()
            forwards, held = scheduler.forwards, scheduler.sequence_forwards
            more = scheduler.step()
            self.metrics.forwards.inc(scheduler.forwards - forwards)
            self.metrics.forward_sequences.inc(scheduler.sequence_forwards - held)
            if not more and stopping:
                return

    def _dequeued(self) -> None:
        with self._lock:
            self._waiting -= 1
            self.metrics.queue_depth.set(self._waiting)

    def _take_view(self, prompt: list[int]):
        """The engine state a job runs on: the idle one whose kept tokens share the longest prefix with ``prompt``,
        else the least recently used idle one, else a new fork."""
        if not self._idle_views:
            return self.tf.fork() if self._can_fork else self.tf
        # LRU first: ties and no match take the oldest
        shared = [common_prefix_length(view.engine.prefix_tokens, prompt) for view in self._idle_views]
        view = self._idle_views.pop(max(range(len(shared)), key=lambda i: (shared[i], -i)))
        self.metrics.prefix_cache_bytes.set(self.kept_cache_bytes)  # its cache is now the running request's
        return view

    @property
    def kept_cache_bytes(self) -> int:
        """Bytes of KV cache the idle engines keep for prefix reuse (the prefix cache)."""
        return sum(view.engine.full_cache.nbytes for view in self._idle_views if view.engine.full_cache is not None)

    def _keep(self, view) -> None:
        """Return ``view`` to the idle engines (most recent last) and evict the least recently used caches past
        the bound (:attr:`prefix_cache_bytes`, :data:`MAX_KEPT_ENGINES`)."""
        self._idle_views.append(view)
        del self._idle_views[:-MAX_KEPT_ENGINES]
        if self.prefix_cache_bytes is None:
            return
        kept = self.kept_cache_bytes
        for old in self._idle_views[:-1]:  # LRU first; the most recent one stays
            if kept <= self.prefix_cache_bytes:
                break
            if old.engine.full_cache is not None:
                kept -= old.engine.full_cache.nbytes
                old.engine.forget_prefix()
        self.metrics.prefix_cache_bytes.set(kept)

    @property
    def keeps_caches(self) -> bool:
        """Whether idle engines keep KV caches for prefix reuse (memory :meth:`free_kept_caches` would free)."""
        return any(view.engine.full_cache is not None for view in self._idle_views)

    def free_kept_caches(self) -> None:
        """Drop the KV caches the idle engines keep for prefix reuse (memory is short)."""
        for view in self._idle_views:
            view.engine.forget_prefix()
        self.metrics.prefix_cache_bytes.set(0)
        import gc

        from ..kv.memory import release_free_memory

        gc.collect()
        release_free_memory()  # give the freed caches' pages back (kv/memory.py)

    def _check_fits(self, tf: "TriForce", req: GenerationRequest) -> None:
        """:func:`check_with_engine` when a job starts; short of memory, the kept caches are dropped and it checks
        again, and a request that still does not fit while others run gets 503 (their memory will free up).

        Raises:
            APIError: 400 as :func:`check_with_engine`, or 503 ``insufficient_memory`` with ``Retry-After``.
        """
        try:
            check_with_engine(tf, req, self.spec)
            return
        except APIError as e:
            if e.code != "insufficient_memory":
                raise
        self.free_kept_caches()
        try:
            check_with_engine(tf, req, self.spec)
        except APIError as e:
            if e.code != "insufficient_memory" or len(self._active) <= 1:
                raise
            raise APIError(503, f"the server is busy: {e.message} while {len(self._active) - 1} other requests run; "
                           "retry later", type="server_error", code="insufficient_memory",
                           headers={"Retry-After": str(self.retry_after())}) from e

    def _run_job(self, job: _Job) -> None:
        """One job, run by the scheduler in its own greenlet."""
        self._dequeued()
        with self._lock:
            self._active[id(job)] = job
        self.metrics.running.set(len(self._active))
        t0, view = time.monotonic(), None
        try:
            view = self._take_view(job.request.prompt_ids)
            if job.shared_prefix is not None:  # another choice of the same prompt prefilled it
                view.engine.adopt_prefix(*job.shared_prefix)
                job.shared_prefix = None
            self._serve(job, view)
        except BaseException as e:  # noqa: BLE001 - a bug must not kill the only worker
            job.post("error", APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error"))
        finally:
            self._release_followers(job, None)  # the first choice ended before a token: the others prefill
            with self._lock:
                del self._active[id(job)]
            self.metrics.running.set(len(self._active))
            if view is not None:
                self._keep(view)
            from ..kv.memory import release_free_memory

            release_free_memory()  # the request's caches were freed: give their pages back (kv/memory.py)
            self._mean_seconds = 0.8 * self._mean_seconds + 0.2 * (time.monotonic() - t0)

    def _release_followers(self, job: _Job, tf: "TriForce | None") -> None:
        """Queue ``job``'s followers (the request's other choices) on the scheduler, with a copy of the prompt's KV
        from ``tf``'s full cache when it holds the prompt (not offloaded), else to prefill it themselves."""
        followers, job.followers = job.followers, []
        if not followers:
            return
        shared, prompt = None, job.request.prompt_ids
        full = tf.engine.full_cache if tf is not None else None
        if full is not None and self._can_fork and not full.offload and full.length >= len(prompt):
            from ..kv.caches import FullKVCache

            copy = FullKVCache(tf.engine.target.cfg, len(prompt), full.k.dtype, full.k.device)
            copy.copy_prefix_from(full, len(prompt))  # positions before the prompt's end hold only the prompt's KV
            shared = (copy, list(prompt))
        for follower in followers:
            follower.shared_prefix = shared
            self._scheduler.submit(lambda f=follower: self._run_job(f))

    def _serve(self, job: _Job, tf: "TriForce") -> None:
        from ..kv.memory import InsufficientMemoryError
        from ..speculation.grammar import GrammarError
        from ..speculation.sampling import SamplingParams

        req, spec = job.request, self.spec
        if job.cancel.is_set():
            job.post("cancelled")
            return
        started = time.monotonic()
        if started > job.deadline:
            self.metrics.ended_early.labels("timeout").inc()
            job.post("error", APIError(504, f"the request waited {started - job.received:.1f} s in the queue, past "
                                       "the server's --request-timeout", type="server_error", code="timeout"))
            return
        try:
            sampling = SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                                      logprobs=req.logprobs)
            self._check_fits(tf, req)  # free memory may have changed while the request waited
        except APIError as e:
            job.post("error", e)
            return
        job.post("started", started - job.received)

        def check(_n: int = 0) -> None:
            if job.cancel.is_set():
                raise _Abort("disconnect")
            if time.monotonic() > job.deadline:
                raise _Abort("timeout")

        if req.echo and req.logprobs is not None:  # one pass of the target over the prompt (speculation/logprobs.py)
            try:
                entries = tf.prompt_logprobs(req.prompt_ids, req.logprobs, progress=check)
            except _Abort as a:
                self.metrics.ended_early.labels(a.reason).inc()
                if a.reason == "timeout":
                    job.post("error", APIError(504, "the request's --request-timeout passed while its prompt was "
                                               "scored (echo)", type="server_error", code="timeout"))
                return
            detok = IncrementalDetokenizer(tf.tokenizer, skip_special_tokens=False)  # each token's text (text_offset;
            pieces = [detok.add(t) for t in req.prompt_ids]  # the echo keeps special tokens, as decode does)
            pieces[-1] += detok.flush()
            job.post("prompt_logprobs", [(describe(tf.tokenizer, e, t), p)
                                         for e, t, p in zip(entries, req.prompt_ids, pieces)])
        if not req.max_tokens:  # echo with max_tokens 0: the prompt scored, nothing generated
            stats = _empty_stats(tf, req, spec, time.monotonic() - started).to_dict()
            job.post("done", {"finish_reason": "length", "text": "", "completion_tokens": 0, "stats": stats})
            return

        gen = tf.stream(req.prompt_ids, max_new_tokens=req.max_tokens, sampling=sampling, spec=spec, seed=req.seed,
                        stop=req.stop, prefill_progress=check, response_format=req.response_format)
        token_text = IncrementalDetokenizer(tf.tokenizer)  # the text each token adds, held back or not (text_offset)
        result, ended, tokens, texts, last = None, None, [], [], 0.0
        try:
            while True:
                try:
                    event = next(gen)
                except StopIteration as s:
                    result = s.value
                    break
                if event.token_id is not None:
                    tokens.append(event.token_id)
                    now = time.monotonic()
                    if len(tokens) > 1:
                        self.metrics.tbt.observe(now - last)
                    else:
                        self._release_followers(job, tf)  # the prompt is prefilled: the other choices start
                    last = now
                texts.append(event.text)
                job.post("token", event, None if event.logprob is None else
                         (describe(tf.tokenizer, event.logprob), token_text.add(event.token_id)))
                try:
                    check()
                except _Abort as a:
                    ended = a.reason
                    break
        except _Abort as a:  # raised by the prefill progress callback: no token yet
            ended = a.reason
        except GrammarError as e:  # the grammar's matcher failed: the request's fault, even mid-stream
            job.post("error", APIError(400, str(e), param="response_format", code="grammar_error"))
            return
        except (InsufficientMemoryError, ValueError) as e:
            if tokens:
                raise
            job.post("error", APIError(400, str(e), code="insufficient_memory" if isinstance(
                e, InsufficientMemoryError) else None))
            return
        finally:
            gen.close()  # stops the engine; its cache keeps exactly the tokens it processed
        if ended is not None:
            self.metrics.ended_early.labels(ended).inc()
        if result is not None:
            stats, finish, text = result.stats, result.finish_reason, result.text
        else:
            stats, finish, text = tf.engine.last_stats, "length", "".join(texts)
            if not tokens or stats is None:  # stopped during the prefill: the engine recorded nothing
                stats = _empty_stats(tf, req, spec, time.monotonic() - started)
            stats.finish_reason = "length"
        self.metrics.generated.inc(len(tokens))
        self.metrics.prompt.inc(len(req.prompt_ids))
        self.metrics.reused.inc(stats.tiers.get("target", {}).get("reused_prefix_tokens", 0) or 0)
        for name, tier in stats.tiers.items():
            if tier.get("verifications"):
                self.metrics.tier_proposed.labels(name).inc(tier["proposed"])
                self.metrics.tier_accepted.labels(name).inc(tier["accepted"])
        if ended == "disconnect":
            return  # nobody is listening
        d = stats.to_dict()
        d["queue_seconds"] = round(started - job.received, 6)
        d["timed_out"] = ended == "timeout"
        job.post("done", {"finish_reason": "length" if finish == "length" else "stop", "text": text,
                          "completion_tokens": len(tokens), "stats": d})


def check_with_engine(tf: "TriForce", req: GenerationRequest, spec: "SpeculationConfig") -> None:
    """The engine's own checks of a request (vocabulary, draft model, sliding window, free memory).

    Raises:
        APIError: 400, with the engine's message (``code`` ``insufficient_memory`` when the caches do not fit).
    """
    from ..kv.memory import InsufficientMemoryError

    try:
        if req.echo and req.logprobs is not None:  # the prompt's own pass (its KV cache, the model's context)
            tf.check_prompt_logprobs(req.prompt_ids, req.logprobs)
        if not req.max_tokens:  # echo with max_tokens 0: the prompt is scored, the engine generates nothing
            return
        tf.engine.plan(req.prompt_ids, req.max_tokens, spec, choose_auto=False)  # checked as plain decoding if auto
    except InsufficientMemoryError as e:
        raise APIError(400, str(e), param="max_tokens", code="insufficient_memory") from e
    except ValueError as e:
        raise _invalid(str(e)) from e


def _empty_stats(tf: "TriForce", req: GenerationRequest, spec: "SpeculationConfig", seconds: float):
    from ..engine import GenerationStats
    from ..kv.memory import peak_memory_bytes

    return GenerationStats(mode=spec.name, prompt_tokens=len(req.prompt_ids), generated_tokens=0,
                           finish_reason="length", prefill_seconds=round(seconds, 6), decode_seconds=0.0,
                           decode_tokens_per_second=0.0, mean_time_between_tokens_ms=0.0,
                           peak_memory_bytes=peak_memory_bytes(tf.target.model.device), seed=req.seed or 0, tiers={})
