"""Speculation tiers: where tokens are drafted, verified and accepted.

A hierarchy is a chain of tiers, bottom-up. In TriForce (arXiv 2404.11912, Sec. 4.2 and Algorithm 1):

====  ===================================  ======================================================
tier  model + cache                        role
====  ===================================  ======================================================
0     draft model + StreamingLLM cache     drafts gamma1 tokens per tier-1 verification
1     target model + retrieval cache       verifies tier 0, proposes gamma2 tokens to tier 2
2     target model + full KV cache         verifies tier 1: decides every token (the output)
====  ===================================  ======================================================

Every tier implements the small :class:`Drafter` interface:

* :meth:`Drafter.propose` ``(seq, n) -> (tokens, probs)``: up to n tokens continuing ``seq`` and, for each, the
  exact distribution it was sampled from (the q of the tier above);
* :meth:`Drafter.rollback` ``(n)``: forget everything past the first n tokens (after a verification above);
* :meth:`Drafter.commit` ``(seq)``: the tokens of ``seq`` are final (the top tier verified them).

:class:`ModelTier` is a model with a cache and, optionally, a drafter below it. One *step* (:meth:`ModelTier.step`)
is one verification: get k <= gamma tokens from the drafter, run the model once over them, accept a prefix
with :func:`~triforce.speculation.rule.rejection_sample` and emit the accepted tokens plus one recovered or bonus
token, each with this tier's own distribution. Without a drafter a step is one autoregressive token. The same
code therefore runs every tier and every mode; a tier's proposals are exactly distributed as its own model
(through its own verification when it has a drafter), which is what keeps the whole chain lossless.

Cache discipline: a tier's cache always holds KV for a prefix of the current sequence (``self.cached``). It
catches up lazily: a forward feeds ``seq[len(cached):]`` (the pending token, the drafts, tokens another tier
produced). After each verification the verifying tier rolls itself and every tier below back to the accepted
prefix, so no cache ever holds a rejected token.
"""

from __future__ import annotations

import time
from typing import Callable, Protocol

import torch

from ..kernels.rows import PREFILL_EXACT_TAIL, prefill_forward_size, verify_forward
from ..kv.caches import CacheError, FullKVCache, KVCache
from ..kv.retrieval import RetrievalCache
from ..kv.streaming import StreamingCache
from ..model.batching import prefill_chunk, run_forward
from ..model.transformer import Transformer
from ..text.tokens import common_prefix_length
from .logprobs import TokenLogprob, token_logprobs
from .rule import rejection_sample
from .sampling import SamplingParams, logits_to_probs
from .stats import TierStats


class Drafter(Protocol):
    """What a tier below needs to offer the tier above it."""

    stats: TierStats

    def propose(self, seq: list[int], n: int) -> tuple[list[int], torch.Tensor]:
        """Up to ``n`` (>= 1) tokens continuing ``seq`` and their sampling distributions, (len, V) fp32."""

    def rollback(self, n: int) -> None:
        """Forget everything past the first ``n`` tokens of the sequence."""

    def commit(self, seq: list[int]) -> None:
        """``seq`` is final: no later rollback goes below ``len(seq) - 1``."""

    def resync(self, seq: list[int]) -> None:
        """Catch up with ``seq`` (final but its last token) after the tier above ran without drafting for a while."""

    def observe(self, accepted: int, proposed: int) -> None:
        """The tier above accepted ``accepted`` of the ``proposed`` tokens this tier just gave it."""

    def prefill(self, prompt: list[int], progress: Callable[[int], None] | None = None) -> None:
        """Process the prompt (all but its last token, which the first proposal feeds)."""

    def all_stats(self) -> list[TierStats]:
        """Stats of this tier and every tier below it, bottom first."""


VerifyFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class ModelTier:
    """A model with a KV cache, optionally sped up by a drafter below it.

    Attribute ``refeed`` (int, >= 1): prompt tokens a prefill feeds again even when prefix reuse holds them; the
    verifier's prefill runs its last ``max(refeed, rows.PREFILL_EXACT_TAIL)`` on the row-invariant paths
    (``rows.prefill_forward_size``), reused or not.

    Args:
        name: tier name used in stats.
        model: the model (tiers 1 and 2 share the target's).
        cache: this tier's cache.
        sampling: sampling parameters, identical in every tier of a hierarchy.
        generator: random source shared by the hierarchy.
        eos_ids: tokens that end generation; proposals stop after one.
        drafter: the tier below, or None (autoregressive).
        gamma: tokens requested from the drafter per verification (>= 1 when there is a drafter).
        is_top: the verifier: prefills the whole prompt and keeps the last prompt token's logits.
        prefill_chunk: tokens per prefill forward.
        verify_fn: the verification rule (tests inject broken variants to prove the tests can fail).
        stop_below: as a drafter, end a proposal before the first token whose model confidence (max probability
            of the tier's softmax at temperature 1) is below this (None: never).
        adaptive_gamma: as a verifier, grow gamma by 1 after a fully accepted block (up to ``2 * gamma``) and
            shrink it by 1 when fewer than half were accepted (down to 1).
        tp: under tensor parallelism, the :class:`~triforce.model.parallel.TensorParallel` whose rank 0 takes every
            verification decision and broadcasts it (the ranks stay in lockstep).

    Both adaptive rules depend only on tokens and distributions already computed, never on the draws still to
    come, so the verification stays exact.
    """

    refeed = 1

    def __init__(self, name: str, model: Transformer, cache: KVCache, sampling: SamplingParams,
                 generator: torch.Generator, eos_ids: tuple[int, ...] = (), drafter: Drafter | None = None,
                 gamma: int = 0, is_top: bool = False, prefill_chunk: int = 512,
                 verify_fn: VerifyFn = rejection_sample, stop_below: float | None = None,
                 adaptive_gamma: bool = False, tp=None) -> None:
        if drafter is not None and gamma < 1:
            raise ValueError(f"gamma must be >= 1 for tier {name!r} with a drafter, got {gamma}")
        self.name, self.model, self.cache = name, model, cache
        self.sampling, self.generator = sampling, generator
        self.eos_ids = frozenset(eos_ids)
        self.drafter, self.gamma, self.is_top = drafter, gamma, is_top
        self.prefill_chunk = prefill_chunk
        self.verify_fn = verify_fn
        self.stop_below, self.adaptive_gamma = stop_below, adaptive_gamma
        self.tp = tp
        self.gamma_max = 2 * gamma
        self.drafting = True  # False: the drafter is bypassed (autoregressive steps; see ``speculation/auto.py``)
        self.confidence: torch.Tensor | None = None  # (len(emitted),) of the last step, when stop_below is set
        self.cached: list[int] = []  # tokens whose KV is in the cache: always a prefix of the sequence
        self.tail_logits: torch.Tensor | None = None  # (V,) logits at position len(cached) - 1, if known
        self.constraint = None  # a grammar.TokenConstraint masking this tier's logits (structured output), or None
        self.logprob_log: list[TokenLogprob] = []  # the verifier with sampling.logprobs set: one per emitted token
        self.stats = TierStats(name)
        if drafter is not None:  # proposals asked per verification (capped per request at max_new_tokens - 1)
            self.stats.extra["gamma"] = gamma

    # ---------------------------------------------------------------- model calls
    def _forward(self, tokens: list[int], num_logits: int | None) -> torch.Tensor:
        start = len(self.cached)
        ids = torch.tensor([tokens], dtype=torch.long, device=self.model.device)
        pos = torch.arange(start, start + len(tokens), device=self.model.device)
        # (1, n, V) fp32; batched under a scheduler, whose seconds exclude the time spent waiting for the batch
        logits, seconds = run_forward(self.model, ids, pos, self.cache, num_logits)
        logits = logits[0]
        self.stats.forward_seconds += seconds
        self.stats.forward_passes += 1
        self.cached.extend(tokens)
        return logits

    def _prefill_tokens(self, tokens: list[int], progress: Callable[[int], None] | None) -> torch.Tensor | None:
        logits = None
        t0, p0 = self.stats.forward_seconds, self.stats.forward_passes
        # the verifier's last prompt tokens run as prefix reuse feeds them again, on the row-invariant paths, the
        # same number in every mode: a reuse of this prompt's KV gives this prefill's tokens (kernels/rows.py)
        tail = max(self.refeed, PREFILL_EXACT_TAIL) if self.is_top else 0
        i, n = 0, len(tokens)
        while i < n:  # beside running generations, chunks sized to keep their streams going
            size = prefill_forward_size(self.cache, n - i, prefill_chunk(self.prefill_chunk), tail)
            chunk, in_tail = tokens[i:i + size], n - i <= tail
            i += size
            logits = verify_forward(self._forward, self.cache, chunk, 1) if in_tail else self._forward(chunk, 1)
            if progress is not None:
                progress(len(chunk))
        self.stats.prefill_seconds += self.stats.forward_seconds - t0
        self.stats.prefill_passes += self.stats.forward_passes - p0
        return None if logits is None else logits[-1]

    def prefill(self, prompt: list[int], progress: Callable[[int], None] | None = None) -> None:
        """Process the prompt: the whole prompt for the top tier (keeping its last logits), else all but the last token.

        Tokens already cached that match the prompt's start are kept (prefix reuse); at least ``refeed`` tokens are
        fed (the engine raises it so the verifier records the queries a retrieval rule with a query window reads).
        The top tier feeds the last ``rows.PREFILL_EXACT_TAIL`` (8, at least ``refeed``) apart from a prefill chunk
        of more than ``rows.EXACT_MAX_BLOCK`` tokens, on the row-invariant paths, as a reuse of the prompt's KV
        feeds them: the same prompt gives the same tokens on a fresh engine and again, in every mode
        (``rows.prefill_forward_size``).
        """
        n = len(prompt) if self.is_top else len(prompt) - 1
        common = common_prefix_length(self.cached, prompt[:max(0, n - self.refeed)])
        self.truncate(common)
        self.stats.extra["reused_prefix_tokens"] = common
        self.tail_logits = self._prefill_tokens(prompt[common:n], progress)
        if self.drafter is not None:
            self.drafter.prefill(prompt, progress)

    def logits_for(self, seq: list[int], n_out: int) -> torch.Tensor:
        """Logits (n_out, V) fp32 at the last ``n_out`` positions of ``seq``, feeding what the cache lacks."""
        n = len(self.cached)
        if seq[max(0, n - 4):n] != self.cached[max(0, n - 4):]:
            raise RuntimeError(f"tier {self.name}: cache does not hold a prefix of the sequence (bug)")
        new = seq[n:]
        if n_out > len(new):
            if n_out != len(new) + 1 or self.tail_logits is None:
                raise RuntimeError(f"tier {self.name}: no logits for position {n - 1} (bug)")
            out = self.tail_logits[None]
            if new:  # the verifier's blocks on the row-invariant paths whatever their length (rows.verify_forward)
                out = torch.cat([out, verify_forward(self._forward, self.cache, new, None)])
        else:
            out = verify_forward(self._forward, self.cache, new, n_out)
        self.tail_logits = out[-1]
        return out[-n_out:]

    # ---------------------------------------------------------------- speculation
    def step(self, seq: list[int], max_tokens: int) -> tuple[list[int], torch.Tensor]:
        """One verification (or one autoregressive token): 1..max_tokens tokens continuing ``seq``.

        Returns:
            ``(tokens, probs)``: the emitted tokens and this tier's distribution for each, (len, V) fp32.
            Tokens stop after an EOS.
        """
        if self.is_top:  # the output will reach at least len(seq): forget the blocks that end before it
            for st in self.all_stats():
                st.blocks[:] = [b for b in st.blocks if b[0] + max(b[1], b[3]) > len(seq)]
        k = min(self.gamma, max_tokens - 1) if self.drafter is not None and self.drafting else 0
        if k > 0:
            drafts, q = self.drafter.propose(seq, k)  # tokens ~ q, q: (k', V)
        else:
            drafts, q = [], None
        k = len(drafts)
        logits = self.logits_for(seq + drafts, k + 1)  # (k+1, V)
        scores = logits if self.constraint is None else self.constraint.mask_logits(logits, seq, drafts)  # grammar.py
        p = logits_to_probs(scores, self.sampling)  # (k+1, V): the same processing as every other tier
        d = torch.tensor([drafts], dtype=torch.long, device=p.device)
        q = q[None] if q is not None else p.new_zeros((1, 0, p.shape[-1]))
        n_acc, nxt = self.verify_fn(d, q, p[None], self.generator, greedy=self.sampling.greedy)
        if self.tp is not None:  # rank 0 decides; every rank applies the same outcome
            n_acc, nxt = self.tp.broadcast_decision(n_acc, nxt)
        n_acc = int(n_acc[0])
        emitted = drafts[:n_acc]
        if not (n_acc == k and k and drafts[-1] in self.eos_ids):  # no bonus after an accepted EOS
            emitted = emitted + [int(nxt[0])]
        # keep the accepted prefix in every cache at and below this tier
        self.truncate(len(seq) + n_acc)
        if self.drafter is not None:
            self.drafter.rollback(len(seq) + n_acc)
        if k:
            self.drafter.observe(n_acc, k)
            s = self.stats
            s.verifications += 1
            s.proposed += k
            s.accepted += n_acc
            s.emitted += len(emitted)
            s.accepted_lengths.extend([0] * (n_acc + 1 - len(s.accepted_lengths)))
            s.accepted_lengths[n_acc] += 1
            s.blocks.append((len(seq), k, n_acc, len(emitted)))
            if self.adaptive_gamma:
                if n_acc == k:
                    self.gamma = min(self.gamma + 1, self.gamma_max)
                elif 2 * n_acc < k:
                    self.gamma = max(1, self.gamma - 1)
        emitted = emitted[:max_tokens]
        if self.is_top and self.sampling.logprobs is not None:  # the target's own distribution (logprobs.py)
            self.logprob_log += token_logprobs(logits, emitted, self.sampling.logprobs)
        if self.stop_below is not None:
            self.confidence = torch.softmax(logits[:len(emitted)].float(), -1).amax(-1)
        return emitted, p[:len(emitted)]

    def propose(self, seq: list[int], n: int) -> tuple[list[int], torch.Tensor]:
        """Up to ``n`` tokens distributed as this tier's model, via as many steps as needed; stops after an EOS."""
        out: list[int] = []
        probs: list[torch.Tensor] = []
        while len(out) < n:
            toks, pr = self.step(seq + out, n - len(out))
            end = len(toks)
            for i, t in enumerate(toks):
                if t in self.eos_ids:
                    end = i + 1
                    break
            unsure = False
            if self.stop_below is not None:
                low = (self.confidence[:end] < self.stop_below).nonzero()
                if len(low):
                    end, unsure = int(low[0]), True
            out += toks[:end]
            probs.append(pr[:end])
            if unsure or end < len(toks) or (end and toks[end - 1] in self.eos_ids):
                break
        if not out:
            return [], torch.zeros((0, probs[0].shape[-1]), device=probs[0].device)
        return out, torch.cat(probs)

    # ---------------------------------------------------------------- cache bookkeeping
    def truncate(self, n: int) -> None:
        """Keep only the first ``n`` cached tokens (no effect if fewer are cached)."""
        if n < len(self.cached):
            self.cache.rollback(n)
            del self.cached[n:]
            self.tail_logits = None

    def rollback(self, n: int) -> None:
        self.truncate(n)
        if self.drafter is not None:
            self.drafter.rollback(n)

    def observe(self, accepted: int, proposed: int) -> None:
        """The tier above accepted ``accepted`` of the ``proposed`` tokens this tier gave it (unused here)."""

    def commit(self, seq: list[int]) -> None:
        if self.drafter is not None and self.drafting:  # a bypassed drafter catches up in resync
            self.drafter.commit(seq)

    def resync(self, seq: list[int]) -> None:
        """Catch up with ``seq`` (its tokens but the last are final): this tier lazily, the tiers below as they need."""
        if self.drafter is not None:
            self.drafter.resync(seq)

    def resume_drafting(self, seq: list[int]) -> None:
        """End a bypass: the drafter chain catches up with ``seq`` and drafts again from the next step."""
        self.drafting = True
        self.resync(seq)

    def all_stats(self) -> list[TierStats]:
        below = self.drafter.all_stats() if self.drafter is not None else []
        return below + [self.stats]

    def set_constraint(self, constraint) -> None:
        """Mask this tier's and every model tier's below it logits with ``constraint`` (``grammar.py``: the same
        mask at the same prefix in every tier keeps the verification exact for the constrained distribution)."""
        self.constraint = constraint
        if hasattr(self.drafter, "set_constraint"):
            self.drafter.set_constraint(constraint)


class RetrievalTier(ModelTier):
    """Tier 1: the target model over a :class:`~triforce.kv.retrieval.RetrievalCache` built from the full cache.

    Extra args:
        full: the verifier's full cache (source of the selection and of exact KV for accepted tokens).
        lookahead: most positions this tier may run ahead of the committed sequence, plus one: the largest gamma of
            this tier and the tiers above it, + 1 (:meth:`~triforce.engine.SpeculationConfig.reach`).
        rebuild_every: re-select chunks every this many committed tokens (None: only when the budget is full).
        rebuild_below: re-select chunks when the acceptance of this tier's proposals over the last
            ``ACCEPTANCE_WINDOW`` proposed tokens falls below this (the authors' suggested adaptive policy; None: off).
    """

    cache: RetrievalCache
    ACCEPTANCE_WINDOW = 16
    #: after a bypass of at most this many committed tokens the tier catches up by feeding them (its next step is a
    #: pass over them) instead of re-selecting its chunks: a pass over 8 tokens costs less than a re-selection, one
    #: over 16 about as much (docs/performance.md, "Figures behind the code's constants"). ``auto`` starts every
    #: request with 4 plain tokens; a real bypass lasts 16 tokens or more.
    CATCH_UP_TOKENS = 8

    def __init__(self, *args, full: FullKVCache, lookahead: int, rebuild_every: int | None = None,
                 rebuild_below: float | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.full, self.lookahead, self.rebuild_every = full, lookahead, rebuild_every
        self.rebuild_below = rebuild_below
        self._recent: list[tuple[int, int]] = []  # (accepted, proposed) of recent verifications by the tier above
        self._query: tuple[int, torch.Tensor] | None = None  # (position, query) of the last selection
        if self.cache.budget - self.cache.chunk_size < lookahead + 1:  # see SpeculationConfig's check
            smallest = self.cache.chunk_size + lookahead + 1
            raise ValueError(f"budget must be at least chunk_size + gamma + 2 = {smallest} so generated tokens fit "
                             f"beside chunk 0, got {self.cache.budget}")

    def prefill(self, prompt: list[int], progress: Callable[[int], None] | None = None) -> None:
        """Select chunks among positions [0, P-1) with the last prompt token's query (position P-1)."""
        t0 = self.stats.forward_seconds
        self._build(prompt[:-1], len(prompt) - 1)
        self.stats.prefill_seconds += self.stats.forward_seconds - t0
        if self.drafter is not None:
            self.drafter.prefill(prompt, progress)

    def _build(self, seq: list[int], length: int) -> None:
        """Select among positions [0, length) with the query of position ``length`` (recorded by the verifier).

        The verifier records the queries of its last forward only. The one position it may need from an older
        forward is the last prompt token's: the first verification reuses the prefill's logits and starts one position
        later, so a re-selection after it that accepted nothing asks for position P-1 again. That query is the one the
        previous selection used, kept here.
        """
        t0 = time.perf_counter()
        try:
            query = self.cache.selection_query(length)
        except CacheError:
            if self._query is None or self._query[0] != length:
                raise
            query = self._query[1]
        self._query = (length, query)
        self.cache.build(length, query)
        self.stats.forward_seconds += time.perf_counter() - t0
        self.cached = list(seq[:length])
        self.tail_logits = None
        self.stats.rebuilds += 1

    def observe(self, accepted: int, proposed: int) -> None:
        """Record how many of this tier's proposed tokens the verifier accepted (for ``rebuild_below``)."""
        self._recent.append((accepted, proposed))
        while sum(p for _, p in self._recent[1:]) >= self.ACCEPTANCE_WINDOW:
            self._recent.pop(0)

    def _acceptance_dropped(self) -> bool:
        proposed = sum(p for _, p in self._recent)
        if self.rebuild_below is None or proposed < self.ACCEPTANCE_WINDOW:
            return False
        return sum(a for a, _ in self._recent) / proposed < self.rebuild_below

    def _rebuild_due(self) -> bool:
        """Whether the chunks must be re-selected: the cache has no room for another step's lookahead past the
        verifier's committed tokens, or ``rebuild_every`` of them came since the last selection."""
        since = self.full.length - self.cache.build_len
        room = self.cache.generation_capacity - since
        return room < self.lookahead + 1 or bool(self.rebuild_every and since >= self.rebuild_every)

    def commit(self, seq: list[int]) -> None:
        """After a top-level verification: copy exact KV of accepted tokens; re-select chunks when due."""
        self.cache.sync_from_full()
        dropped = self._acceptance_dropped()
        if dropped:
            self._recent.clear()
            self.stats.extra["acceptance_rebuilds"] = self.stats.extra.get("acceptance_rebuilds", 0) + 1
        if self._rebuild_due() or dropped:
            # like the first build: select among the positions before the verifier's newest token, with its query
            # (the verifier holds every committed token but the newest: full.length == len(seq) - 1)
            self._build(seq, self.full.length - 1)
        super().commit(seq)

    def resync(self, seq: list[int]) -> None:
        """After a bypass: re-select the chunks as a rebuild at commit does (the verifier's newest query), unless at
        most :attr:`CATCH_UP_TOKENS` tokens were committed meanwhile and the cache has room for them: then the tier
        feeds them at its next step, and the next commit replaces their KV with the verifier's exact KV, as for any
        token it generates. Either way only the proposals change, never the output (the verifier decides)."""
        behind = len(seq) - 1 - len(self.cached)  # committed tokens the tier has not fed (the newest is pending)
        if behind > self.CATCH_UP_TOKENS or self._rebuild_due():
            self._build(seq, self.full.length - 1)
        super().resync(seq)


class StreamingTier(ModelTier):
    """Tier 0: a small model (or the target's quantized copy) over a :class:`~triforce.kv.streaming.StreamingCache`.

    Prefill feeds the sinks and the last ``PREFILL_WINDOWS`` windows of the prompt, skipping the middle
    (:meth:`~triforce.kv.streaming.StreamingCache.skip_to`): a StreamingLLM cache keeps only those, so a long prompt
    costs the drafter a few hundred tokens instead of all of them. This changes proposals slightly, never the output.
    """

    cache: StreamingCache
    PREFILL_WINDOWS = 2

    def _feed(self, tokens: list[int]) -> int:
        """Feed the final ``tokens[len(cached):]``, skipping the middle of a long run; returns the tokens fed."""
        start, end, sink = len(self.cached), len(tokens), self.cache.sink
        tail = self.PREFILL_WINDOWS * self.cache.window
        spans = [(start, end)]
        if end - max(start, sink) > tail + self.prefill_chunk:  # the sinks, then the last windows
            spans = [(start, max(start, min(sink, end))), (end - tail, end)]
        for lo, hi in spans:
            if lo > len(self.cached):
                self.cache.skip_to(lo)
                self.cached = list(tokens[:lo])
            for i in range(lo, hi, self.prefill_chunk):
                self.cache.floor = i  # these tokens are final: nothing below i will be rolled back
                self._forward(tokens[i:min(hi, i + self.prefill_chunk)], 1)
        self.tail_logits = None
        return sum(hi - lo for lo, hi in spans)

    def prefill(self, prompt: list[int], progress: Callable[[int], None] | None = None) -> None:
        self.truncate(0)
        self.cache.floor = 0
        t0, p0 = self.stats.forward_seconds, self.stats.forward_passes
        self.stats.extra["prefill_tokens"] = self._feed(prompt[:-1])
        self.stats.prefill_seconds += self.stats.forward_seconds - t0  # its part of forward_seconds, as every tier's
        self.stats.prefill_passes += self.stats.forward_passes - p0
        if self.drafter is not None:
            self.drafter.prefill(prompt, progress)

    def resync(self, seq: list[int]) -> None:
        """After a bypass: feed the tokens committed meanwhile (the sinks and last windows of them)."""
        self._feed(seq[:-1])
        super().resync(seq)

    def commit(self, seq: list[int]) -> None:
        self.cache.floor = max(self.cache.floor, len(seq) - 1)
        super().commit(seq)
