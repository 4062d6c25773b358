"""Step times: what a verifier's decode step, its verification of a block and a retrieval tier's step cost, timed
where the engine runs, for ``--mode auto`` to weigh a retrieval tier by time rather than by bytes.

Speculation pays when a verification emits more tokens than it costs decode steps (Leviathan et al. 2023, arXiv
2211.17192, Sec. 3.4). With a retrieval tier proposing ``gamma`` tokens (TriForce, arXiv 2404.11912, Sec. 4) one
round costs ``gamma`` retrieval steps and one verification of ``gamma + 1`` tokens, and emits
``(1 - alpha^(gamma+1)) / (1 - alpha)`` tokens (Sec. 3.3, Eq. 1), so its speed over plain decoding is

    tokens(alpha, gamma) * decode / (gamma * lower + verify)

(:meth:`StepTimes.predicted_speedup`). Bytes alone mispredict both ends: on a small model a step is bound by
per-layer work, and at long contexts a verification's attention by arithmetic (docs/auto.md,
docs/long_documents.md). So the forwards are timed, over caches of the request's length holding zeros (a step's
time does not depend on the values it reads), once per engine and shape.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from ..kv.caches import FullKVCache
from ..kv.retrieval import RetrievalCache
from ..model.transformer import Transformer


@dataclass(frozen=True)
class StepTimes:
    """Seconds of the three forwards a retrieval tier's speed rests on, timed together in each of several
    interleaved repetitions (:func:`measure_step_times`).

    Attributes:
        context: tokens in the full KV cache the verifier's forwards attended over.
        budget: slots of the retrieval cache the tier's step attended over.
        block: tokens of the timed verification (``gamma + 1``: the pending token and ``gamma`` proposals).
        samples: per repetition, ``(decode, verify, lower)`` seconds: the verifier's decode step (1 token over the
            full cache), its forward over ``block`` tokens (logits for each), and the tier's step (the lower-precision
            copy, 1 token over the retrieval cache).
    """

    context: int
    budget: int
    block: int
    samples: tuple[tuple[float, float, float], ...]

    def __post_init__(self) -> None:
        if not self.samples or any(len(s) != 3 or min(s) < 0 for s in self.samples):
            raise ValueError(f"samples must be a non-empty tuple of (decode, verify, lower) seconds >= 0, "
                             f"got {self.samples!r}")

    @property
    def decode(self) -> float:
        """Median seconds of the verifier's decode step."""
        return statistics.median(s[0] for s in self.samples)

    @property
    def verify(self) -> float:
        """Median seconds of the verifier's forward over ``block`` tokens."""
        return statistics.median(s[1] for s in self.samples)

    @property
    def lower(self) -> float:
        """Median seconds of the tier's step."""
        return statistics.median(s[2] for s in self.samples)

    def predicted_speedup(self, alpha: float, gamma: int) -> float:
        """Plain decoding's time per token over the tier's, for ``gamma`` proposals per verification accepted
        independently with probability ``alpha`` (module docstring; Leviathan et al. 2023, Sec. 3.3-3.4): the median
        over the repetitions of each one's prediction, so that a slow phase of the machine, which slows the three
        forwards of one repetition alike, cancels out.

        Raises:
            ValueError: ``alpha`` outside [0, 1], or ``gamma`` is not ``block - 1`` (the verification timed).
        """
        if gamma != self.block - 1:
            raise ValueError(f"gamma must be {self.block - 1} (the verification of {self.block} tokens timed), "
                             f"got {gamma!r}")
        tokens = expected_tokens(alpha, gamma)
        return statistics.median(tokens * d / max(1e-12, gamma * lo + v) for d, v, lo in self.samples)

    def describe(self) -> str:
        """One phrase with the median times in ms, for a plan's reason."""
        return (f"measured at {self.context} tokens: decode step {1000 * self.decode:.1f} ms, verification of "
                f"{self.block} {1000 * self.verify:.1f} ms, {self.budget}-slot retrieval step "
                f"{1000 * self.lower:.1f} ms")


def expected_tokens(alpha: float, gamma: int) -> float:
    """Expected tokens one verification emits: ``(1 - alpha^(gamma+1)) / (1 - alpha)``, ``gamma + 1`` at alpha = 1.

    Leviathan et al. 2023 (arXiv 2211.17192), Sec. 3.3, Eq. 1: with each of ``gamma`` drafted tokens accepted
    independently with probability ``alpha`` (the acceptance rate), a verification emits the accepted prefix plus
    one recovered or bonus token.

    Args:
        alpha: acceptance rate, a float in [0, 1].
        gamma: drafted tokens per verification, an integer >= 0.

    Returns:
        Tokens per verification, in [1, gamma + 1].

    Raises:
        ValueError: alpha outside [0, 1] or gamma not an integer >= 0.
    """
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha (acceptance rate) must be a number in [0, 1], got {alpha!r}")
    if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 0:
        raise ValueError(f"gamma must be an integer >= 0, got {gamma!r}")
    if alpha == 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def time_interleaved(calls: dict[str, Callable[[], None]], reps: int, device: torch.device,
                     progress: Callable[[int], None] | None = None) -> dict[str, list[float]]:
    """Wall seconds of each call, ``reps`` times, interleaved: one untimed warm-up of each, then each repetition runs
    every call once in an order rotated from one repetition to the next, so that a slow phase of the machine slows
    every kind alike. CUDA work is synchronised around each call.

    Returns:
        ``{name: [seconds of each repetition]}``. Raises what the calls raise.
    """
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    names = list(calls)
    for name in names:
        calls[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            sync()
            t0 = time.perf_counter()
            calls[name]()
            sync()
            times[name].append(time.perf_counter() - t0)
            if progress is not None:
                progress(1)
    return times


def forward_call(model: Transformer, cache, start: int, t: int,
                 after: Callable[[torch.Tensor], None] | None = None) -> Callable[[], None]:
    """A call that runs ``model`` over ``t`` tokens at positions [start, start + t) of ``cache`` (logits for each),
    hands the (t, V) logits to ``after`` if given, and rolls the cache back to ``start``: every call sees the same
    context. The token ids are 0..t-1 (a forward's time does not depend on them)."""
    tok = torch.arange(t, device=model.device)[None] % model.cfg.vocab_size  # (1, t)
    pos = torch.arange(start, start + t, device=model.device)  # (t,)

    @torch.no_grad()
    def run() -> None:
        logits = model(tok, pos, cache, num_logits=t)[0]  # (t, V)
        if after is not None:
            after(logits)
        cache.rollback(start)
    return run


def measure_step_times(target: Transformer, lower: Transformer, context: int, budget: int, gamma: int,
                       chunk_size: int, kv_dtype: torch.dtype, lower_kv: torch.dtype, reps: int = 7,
                       reuse: FullKVCache | None = None) -> StepTimes:
    """Time the verifier's decode step and its verification of ``gamma + 1`` tokens over a full KV cache of
    ``context`` tokens, and the retrieval tier's step (``lower``, 1 token) over a ``budget``-slot retrieval cache built
    from it, the three in each of ``reps`` interleaved repetitions (:func:`time_interleaved`). The caches hold zeros and
    are freed before returning; the target's RoPE is left as it was.

    Args:
        target: the verifier; lower: the copy of it the tier runs (``Engine.lower_model``; the target itself too).
        context: positions in the full cache; budget: retrieval slots (>= chunk_size + gamma + 2).
        gamma: proposals per verification (>= 1); chunk_size: retrieval chunk size (>= 1).
        kv_dtype, lower_kv: dtypes of the full and the retrieval cache.
        reps: timed repetitions of each forward (>= 1).
        reuse: the engine's kept full cache (a prefix the request reuses), timed in place of a new one where it fits:
            the timed forwards write only positions from ``context`` on, past every token it holds, and its length
            is restored.

    Memory: without a cache to reuse, one of ``context + gamma + 1`` positions is allocated for the measurement (the
    request's own is allocated after it is freed).

    Raises:
        ValueError: a size out of the ranges above.
    """
    for name, value, least in (("context", context, 1), ("gamma", gamma, 1), ("chunk_size", chunk_size, 1),
                               ("reps", reps, 1), ("budget", budget, chunk_size + gamma + 2)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    rope = target.rope
    fits = reuse is not None and not reuse.offload and reuse.capacity >= context + gamma + 1 and \
        reuse.length <= context and reuse.k.dtype == kv_dtype and reuse.device == torch.device(target.device)
    try:
        target.set_request_length(context + gamma + 1)
        lower.rope = target.rope
        full = reuse if fits else FullKVCache(target.cfg, context + gamma + 1, kv_dtype, target.device)
        kept = (full.length, full.record_queries)
        full.length, full.record_queries = context, False  # a step's time does not depend on the values
        retrieval = RetrievalCache(target.cfg, full, budget, chunk_size, dtype=lower_kv)
        cfg = target.cfg
        retrieval.build(context, torch.zeros(cfg.num_hidden_layers, 1, cfg.num_attention_heads, cfg.head_dim,
                                             device=target.device))
        times = time_interleaved({"decode": forward_call(target, full, context, 1),
                                  "verify": forward_call(target, full, context, gamma + 1),
                                  "lower": forward_call(lower, retrieval, context, 1)}, reps, target.device)
    finally:
        target.rope = lower.rope = rope
        if fits:
            reuse.length, reuse.record_queries = kept
    return StepTimes(context, budget, gamma + 1, tuple(zip(times["decode"], times["verify"], times["lower"])))
