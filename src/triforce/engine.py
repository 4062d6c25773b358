"""The engine: builds the tier hierarchy of a request's plan, prefills, runs the decode loop, measures.

Set-up is two steps: :meth:`Engine.plan` checks a request, resolves ``auto``, sizes and places its caches once
(a :class:`~triforce.plan.RequestPlan`), and :meth:`Engine.build_hierarchy` turns that plan into tiers.
Tools reach the engine through public hooks only (:attr:`Engine.full_cache`, :attr:`Engine.prefix_tokens`,
:meth:`Engine.adopt_prefix`, :meth:`Engine.forget_prefix`, :meth:`Engine.lower_model`).

Modes (all lossless; see ``speculation/tiers.py`` for the tiers):

================  =====================================================================
``autoregressive`` target + full cache, one token per forward
``retrieval``      target + retrieval cache drafts gamma2 tokens for target + full cache
``draft``          draft model + StreamingLLM cache drafts gamma2 tokens for target + full
``triforce``       draft drafts gamma1 for target + retrieval, which drafts gamma2 for target + full
``auto``           one of the above, chosen per request, bypassed while it does not pay (``speculation/auto.py``)
================  =====================================================================

The bottom drafter of ``draft`` and ``triforce`` is a draft model, the model-free n-gram drafter (``ngram``), or
the target drafting for itself (``self``: its weights quantized to int4 over a StreamingLLM cache, QuantSpec-style,
arXiv 2502.10424), so every model gets all three tiers without a second model.

:meth:`Engine.stream` is a generator that yields token ids as the verifier accepts them and returns
:class:`GenerationStats`; :meth:`Engine.generate` is the non-streaming call.
"""

from __future__ import annotations

import copy
import math
import os
import time
from dataclasses import replace
from typing import Callable, Generator

import torch

from .defaults import DEFAULTS, SELF_WEIGHTS  # noqa: F401  (SELF_WEIGHTS re-exported)
from .errors import ParameterError
from .kv.caches import KV_DTYPES, FullKVCache, kv_bytes  # noqa: F401  (KV_DTYPES re-exported)
from .kv.memory import KVPlacement, available_bytes, peak_memory_bytes
from .kv.retrieval import RetrievalCache
from .kv.streaming import StreamingCache
from .model.batching import others_running
from .model.cudagraph import model_graphs_apply
from .model.parallel import agree_on_fit
from .model.quant import int8_copy_bytes, lower_precision_copy
from .model.transformer import Transformer
from .plan import DRAFT_PREFILL_CHUNK, RequestPlan, check_plan_fits, draft_kv_dtype, size_caches, size_request
from .speculation.auto import AutoPlan, SpeedGovernor, bf16_cache_reads_fast, choose_hierarchy
from .speculation.hierarchy import (  # noqa: F401
    DRAFTER_KINDS,
    MAX_SEED,
    MODES,
    TIER_KINDS,
    SpeculationConfig,
    _positive_int,
)
from .speculation.ngram import NGramDrafter
from .speculation.rule import rejection_sample
from .speculation.sampling import SamplingParams
from .speculation.stats import GenerationStats  # noqa: F401  (re-exported)
from .speculation.steptimes import StepTimes, measure_step_times
from .speculation.tiers import ModelTier, RetrievalTier, StreamingTier, VerifyFn


class Engine:
    """Runs generation for a target model and an optional draft model.

    Args:
        target: the target model (tiers 1 and 2 share its weights).
        draft: a small model with the same tokenizer, for the ``draft`` and ``triforce`` modes.
        eos_ids: tokens that end generation.
        reuse_prefix: keep the full KV cache between requests and prefill only what follows the longest common
            prefix of the new prompt with the previous request's tokens (multi-turn chat over a long document).
        offload_kv: keep the verifier's full KV cache in host memory, streamed to the device layer by layer with
            one layer of prefetch (:class:`~triforce.kv.caches.FullKVCache`); the other caches stay on the device.
        on_chip_layers: with ``offload_kv``, leading layers kept on the device (None: the memory planner chooses
            from free device memory, :func:`~triforce.kv.memory.place_kv`).
        kv_dtype: dtype of every KV cache (a name of :data:`~triforce.kv.caches.KV_DTYPES`; None: the target's dtype).
            The full cache's dtype is the verifier's, so it changes the output distribution like ``--dtype`` does;
            ``SpeculationConfig.lower_kv_dtype`` changes only the lower tiers' caches, at no loss.

    Hooks tests and benchmarks replace: ``tier_verify`` maps a tier name to a replacement verification rule;
    ``governor_factory(top)`` makes the :class:`~triforce.speculation.auto.SpeedGovernor` of an ``auto`` request;
    :meth:`choose_auto` and :meth:`step_times` are the two steps of ``auto``'s choice inside :meth:`plan`.
    """

    def __init__(self, target: Transformer, draft: Transformer | None = None, eos_ids: tuple[int, ...] = (),
                 reuse_prefix: bool = True, offload_kv: bool = False, on_chip_layers: int | None = None,
                 kv_dtype: str | None = None) -> None:
        self.target, self.draft = target, draft
        if kv_dtype is not None and kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
        self.kv_dtype = KV_DTYPES[kv_dtype] if kv_dtype else target.dtype  # every cache's default dtype
        self._lower: dict[tuple[int, str], Transformer] = {}  # lower-precision copies, by (id(model), scheme)
        self.reuse_prefix = reuse_prefix
        if not isinstance(offload_kv, bool):
            raise ValueError(f"offload_kv must be True or False, got {offload_kv!r}")
        L = target.cfg.num_hidden_layers
        if on_chip_layers is not None and (not offload_kv or isinstance(on_chip_layers, bool)
                                           or not isinstance(on_chip_layers, int) or not 0 <= on_chip_layers <= L):
            raise ValueError(f"on_chip_layers must be an integer in [0, {L}] and needs offload_kv, "
                             f"got {on_chip_layers!r}")
        self.offload_kv, self.on_chip_layers = offload_kv, on_chip_layers
        self.placement: KVPlacement | None = None  # the offloading plan of the request running (or the last one)
        self.eos_ids, self.last_stats = tuple(eos_ids), None  # last_stats: the last request's GenerationStats
        self.logprob_log: list = []  # the running (or last) request's log-probabilities, one per token
        # prefix reuse: the verifier's full cache and the tokens it holds, kept from the previous request
        self._full: FullKVCache | None = None
        self._full_tokens: list[int] = []
        self._retrieval: RetrievalCache | None = None  # the last request's (RetrievalCache.reset_or_new)
        self.tier_verify: dict[str, VerifyFn] = {}  # per-tier override of the verification rule (tests)
        self.governor_factory: Callable = SpeedGovernor  # mode auto: when to bypass the drafters (tests swap it)
        self.measured_steps: dict | None = {}  # mode auto: StepTimes by shape (step_times); None: decide on bytes

    # ------------------------------------------------------------------ public hooks (benchmarks, tests, server)
    @property
    def full_cache(self) -> FullKVCache | None:
        """The verifier's full KV cache kept from the last request (prefix reuse), or None. Read-only use."""
        return self._full

    @property
    def retrieval_cache(self) -> RetrievalCache | None:
        """The retrieval cache of the last request, which the next reuses where its settings match. Read-only use."""
        return self._retrieval

    @property
    def lower_copies(self) -> list[str]:
        """The schemes (``int8``, ``int4``, ...) of the lower-precision copies of the target the engine holds."""
        return [scheme for (model, scheme) in self._lower if model == id(self.target)]

    @property
    def prefix_tokens(self) -> list[int]:
        """The tokens whose KV :attr:`full_cache` holds (a copy), what the next request may reuse."""
        return list(self._full_tokens)

    def adopt_prefix(self, cache: FullKVCache, tokens: list[int]) -> None:
        """Hand the engine a full KV cache holding the KV of ``tokens`` (positions 0 .. len-1), to be reused by the next
        request as if a previous request had left it (benchmarks: a prefill computed elsewhere, random KV).

        Raises:
            ValueError: ``cache.length`` differs from ``len(tokens)``, or the cache is not the target's shape.
        """
        if cache.length != len(tokens):
            raise ValueError(f"tokens: the cache holds {cache.length} positions, got {len(tokens)} tokens")
        if cache.k.shape[0] != self.target.cfg.num_hidden_layers:
            raise ValueError(f"cache: {cache.k.shape[0]} layers, the target has {self.target.cfg.num_hidden_layers}")
        self._full, self._full_tokens = cache, list(tokens)

    def forget_prefix(self) -> None:
        """Drop the kept full KV cache and retrieval cache: the next request prefills its whole prompt anew."""
        self._full, self._full_tokens, self._retrieval = None, [], None

    def lower_model(self, model: Transformer, weights: str | None) -> Transformer:
        """``model`` itself (``weights`` None), or its lower-precision copy for the tiers below the verifier
        (``int8``, ``int4``, ``bfloat16``; ``model/quant.py``), made once and kept; its RoPE and its CUDA-graph setting
        (``model/cudagraph.py``) follow ``model``'s."""
        if weights is None:
            return model
        key = (id(model), weights)
        if key not in self._lower:
            self._lower[key] = lower_precision_copy(model, weights)
        lower = self._lower[key]
        lower.rope = model.rope  # RoPE is fixed per request (dynamic NTK): follow the source model
        lower.cuda_graphs = model.cuda_graphs
        return lower

    # ------------------------------------------------------------------ set-up: plan, then build the tiers
    def plan(self, prompt_ids: list[int], max_new_tokens: int, spec: SpeculationConfig, *,
             sampling: SamplingParams = SamplingParams(), seed: int | None = None,
             choose_auto: bool = True) -> RequestPlan:
        """Check a request and size and place it once, before any heavy work: what :meth:`stream` does first.

        Caps every gamma at what the request can use (``SpeculationConfig.for_request``), resolves ``mode='auto'``
        (:meth:`choose_auto`), sizes every cache (:func:`~triforce.plan.size_caches`), places the full cache's
        layers with ``offload_kv`` and checks that the caches fit in free memory (``plan.check_plan_fits``).

        Args:
            prompt_ids: the prompt, a list of int token ids. max_new_tokens: tokens to generate (>= 1).
            spec, sampling, seed: as :meth:`stream` takes them.
            choose_auto: resolve ``mode='auto'`` (which may time steps and make a weight copy, kept for later
                requests); False: an ``auto`` request is checked as plain decoding and nothing on the engine changes
                (a server checks one request while another runs).

        Returns:
            :class:`~triforce.plan.RequestPlan`: its ``spec`` is the hierarchy to run, its ``auto`` the
            :class:`~triforce.speculation.auto.AutoPlan` (None unless ``auto`` was chosen). :meth:`stream` keeps
            the plan's placement (:attr:`placement`) only when its request starts.

        Raises:
            ValueError: arguments of the wrong type or range (named), an empty prompt, a token id outside the
                vocabulary, a draft mode without a draft model, a request longer than a sliding window or the
                model's context.
            InsufficientMemoryError: the caches do not fit in free memory (under tensor parallelism: on any rank,
                agreed by every rank, :func:`~triforce.model.parallel.agree_on_fit`).
        """
        if isinstance(prompt_ids, (str, bytes)) or not isinstance(prompt_ids, (list, tuple)):
            raise ValueError(f"prompt_ids must be a list of token ids (int), got {type(prompt_ids).__name__}")
        if any(isinstance(t, bool) or not isinstance(t, int) for t in prompt_ids):
            bad = next(t for t in prompt_ids if isinstance(t, bool) or not isinstance(t, int))
            raise ValueError(f"prompt_ids must be token ids (int), got {bad!r}")
        if not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        if not isinstance(spec, SpeculationConfig):
            raise ValueError(f"spec must be a SpeculationConfig, got {type(spec).__name__}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED):
            raise ValueError(f"seed must be an integer in [0, 2**63 - 1], got {seed!r}")
        prompt_ids = list(prompt_ids)
        if not prompt_ids:
            raise ValueError("prompt is empty: give at least one token")
        _positive_int("max_new_tokens", max_new_tokens)
        vocab = self.target.cfg.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {vocab}), got {bad[:5]}")
        spec = spec.for_request(max_new_tokens)  # no gamma above what the request can use (sized for the cap)
        auto = self.choose_auto(len(prompt_ids), sampling, spec) if choose_auto and spec.chooses_per_request \
            else None
        spec = spec.resolve_auto(auto) if auto is not None else spec
        if spec.uses_draft and self.draft is None:
            raise ParameterError(f"`mode` {spec.name!r} needs a draft model (`draft`), or `drafter` ngram for the "
                                 "model-free drafter; without one use `mode` autoregressive or retrieval")
        cfg = self.target.cfg
        cfg.check_length(size_request(len(prompt_ids), max_new_tokens, spec)[0])  # before any allocation or placement
        context = cfg.max_position_embeddings
        if cfg.rope_type != "dynamic" and len(prompt_ids) >= context:
            raise ParameterError(f"`max_prompt_tokens`: the prompt has {len(prompt_ids)} tokens, the model's context "
                                 f"{context}: keep the first N with `max_prompt_tokens` N (at most {context} less the "
                                 "new tokens)")
        if cfg.rope_type != "dynamic" and len(prompt_ids) + max_new_tokens > context:
            raise ValueError(f"max_new_tokens={max_new_tokens} with a prompt of {len(prompt_ids)} tokens exceeds the "
                             f"model's context of {context} tokens (max_position_embeddings)")

        def fit() -> RequestPlan:
            plan = self._size_caches(len(prompt_ids), max_new_tokens, spec)
            weights = self.target.weight_bytes() + (self.draft.weight_bytes() if self.draft else 0)
            check_plan_fits(plan, self.target.device, weights)
            return plan

        plan = agree_on_fit(self.target.tp, fit)
        return replace(plan, auto=auto) if auto is not None else plan

    def _size_caches(self, prompt_tokens: int, max_new_tokens: int, spec: SpeculationConfig) -> RequestPlan:
        """:func:`~triforce.plan.size_caches` with this engine's models and settings (with offloading it reads free
        device memory to place the full cache's layers)."""
        fixed, full = self.on_chip_layers, self._full
        if fixed is None and full is not None and full.offload \
                and full.capacity >= size_request(prompt_tokens, max_new_tokens, spec)[0]:
            fixed = full.on_chip_layers  # the cache kept for prefix reuse keeps its placement
        return size_caches(self.target, self.draft, spec, prompt_tokens, max_new_tokens, self.kv_dtype,
                           existing_copies=self._lower.keys(), offload_kv=self.offload_kv, on_chip_layers=fixed)

    def choose_auto(self, prompt_tokens: int, sampling: SamplingParams, spec: SpeculationConfig) -> AutoPlan:
        """The hierarchy ``mode='auto'`` runs for a prompt of ``prompt_tokens`` (called by :meth:`plan`;
        :func:`~triforce.speculation.auto.choose_hierarchy` with this engine's models). A retrieval tier is weighed
        on measured step times (:meth:`step_times`), except where :attr:`measured_steps` is None, under tensor
        parallelism (ranks must agree) or with an offloaded cache."""
        bottom = DRAFTER_KINDS[spec.drafter] if spec.drafter != "model" or self.draft is not None else None
        copies = set(self._lower)
        measure = None if self.measured_steps is None or self.target.tp is not None or self.offload_kv else \
            (lambda b, g, w, kv: self.step_times(prompt_tokens, b, g, w, kv, spec.chunk_size))
        auto = choose_hierarchy(self.target.cfg, self.target.weight_bytes(), self.kv_dtype, prompt_tokens, bottom,
                                sampling, gamma1=spec.gamma1, gamma2=spec.gamma2, chunk_size=spec.chunk_size,
                                max_budget=spec.budget, device_type=self.target.device.type,
                                draft_weight_bytes=self.draft.weight_bytes() if self.draft is not None else None,
                                step_weight_bytes=self.target.step_weight_bytes(),
                                int8_weight_bytes=int8_copy_bytes(self.target),
                                lower_kv_bf16=bf16_cache_reads_fast(self.target.device.type),
                                lower_kv_dtype=KV_DTYPES.get(spec.lower_kv_dtype),
                                adaptive_gamma=spec.adaptive_gamma, measure=measure)
        if auto.budget is None:  # a copy made only to time a tier the plan leaves out is not kept
            for key in set(self._lower) - copies:
                del self._lower[key]
        return auto

    def step_times(self, context: int, budget: int, gamma: int, lower_weights: str, lower_kv: torch.dtype,
                   chunk_size: int = DEFAULTS["chunk_size"]) -> StepTimes | None:
        """A retrieval tier's :class:`~.speculation.steptimes.StepTimes` at ``context`` tokens, for
        :meth:`choose_auto`: measured once per shape (contexts within 25% share one), kept in :attr:`measured_steps`
        (forks share it). None where its caches would take over half the free memory, or while other generations
        of a batch run (measuring would stall them; ``auto`` then decides on bytes)."""
        key = (round(math.log(context, 1.25)), budget, gamma, lower_weights, lower_kv)
        if key not in self.measured_steps:
            if others_running():
                return None
            cfg = self.target.cfg
            scratch = kv_bytes(cfg, context + gamma + 1, self.kv_dtype) + kv_bytes(cfg, budget, lower_kv)
            if 2 * scratch > available_bytes(self.target.device):
                return None
            lower = self.lower_model(self.target, lower_weights)
            self.measured_steps[key] = measure_step_times(self.target, lower, context, budget, gamma, chunk_size,
                                                          self.kv_dtype, lower_kv, reuse=self._full)
        return self.measured_steps[key]

    def build_hierarchy(self, plan: RequestPlan, sampling: SamplingParams, generator: torch.Generator) -> ModelTier:
        """Allocate the caches of ``plan`` (from :meth:`plan`) and chain the tiers of ``plan.spec``; returns the
        top (verifier) tier, its prefill to come."""
        prompt_tokens, max_new_tokens, spec = plan.prompt_tokens, plan.max_new_tokens, plan.spec
        total = plan.full_capacity
        common = dict(sampling=sampling, generator=generator, eos_ids=self.eos_ids, tp=self.target.tp)
        full, reused = self._full, list(self._full_tokens)
        if self._retrieval is not None:  # a kept retrieval cache must not keep a full cache alive
            self._retrieval.full = None
        placement = plan.placement
        on_chip = placement.on_chip_layers if placement else self.target.cfg.num_hidden_layers
        moved = full is not None and (full.offload != self.offload_kv or full.on_chip_layers != on_chip)
        length = prompt_tokens + max_new_tokens  # dynamic NTK's frequencies: from the request's length, in every mode
        if full is None or not self.reuse_prefix or not self.target.rope_fits(length):
            self._full = full = None  # free the old cache (a dynamic-NTK prefix rotated for another length too)
            reused = []
        if full is None or full.capacity < total or moved:
            if full is None:
                self.target.set_request_length(length)
            bigger = FullKVCache(self.target.cfg, max(total, full.capacity if full is not None else 0),
                                 self.kv_dtype, self.target.device, offload=self.offload_kv,
                                 on_chip_layers=placement.on_chip_layers if placement else None)
            if full is not None:  # a longer request, or a new placement: keep the previous tokens' KV
                bigger.copy_prefix_from(full, full.length)
            self._full = full = None
            full = bigger
        full.record_queries = spec.uses_retrieval
        self._full, self._full_tokens = full, []
        drafter, gamma = None, 0  # the tier built so far and how many tokens it proposes per verification
        refeed = 1
        for index, (kind, proposes) in enumerate(spec.chain):
            verify = self.tier_verify.get(kind, rejection_sample)
            adaptive = dict(stop_below=spec.stop_below, adaptive_gamma=spec.adaptive_gamma and drafter is not None)
            if kind == "ngram":
                node = NGramDrafter(self.target.cfg.vocab_size, spec.ngram_n, self.eos_ids, self.target.device,
                                    min_n=min(spec.ngram_min, spec.ngram_n))
            elif kind in ("draft", "self"):  # a small model, or the target's quantized weights, over StreamingLLM
                if kind == "draft":
                    self.draft.set_request_length(length)
                    d = self.lower_model(self.draft, spec.lower_weights)
                    kv = draft_kv_dtype(self.target, self.draft, self.kv_dtype)
                else:
                    d, kv = self.lower_model(self.target, spec.self_weights), self.kv_dtype
                kv = KV_DTYPES[spec.lower_kv_dtype] if spec.lower_kv_dtype else kv
                cache = StreamingCache(d.cfg, spec.draft_sink, spec.draft_window, plan.streaming_extra, d.rope, kv,
                                       d.device, fixed_shape=model_graphs_apply(d))
                node = StreamingTier(kind, d, cache, drafter=drafter, gamma=gamma,
                                     prefill_chunk=DRAFT_PREFILL_CHUNK, verify_fn=verify, **adaptive, **common)
            else:
                previous, self._retrieval = self._retrieval, None  # kept from the last request, with its CUDA graphs
                cache = self._retrieval = RetrievalCache.reset_or_new(
                    previous, self.target.cfg, full, spec.budget, spec.chunk_size, spec.chunk_score,
                    dtype=KV_DTYPES[spec.lower_kv_dtype] if spec.lower_kv_dtype else None)
                refeed = max(refeed, cache.query_window)  # the prompt's last forward records its query window
                node = RetrievalTier("retrieval", self.lower_model(self.target, spec.lower_weights), cache,
                                     drafter=drafter, gamma=gamma, full=full, lookahead=spec.reach(index) + 1,
                                     rebuild_every=spec.rebuild_every, rebuild_below=spec.rebuild_below,
                                     verify_fn=verify, **adaptive, **common)
            drafter, gamma = node, proposes
        top = ModelTier("target", self.target, full, drafter=drafter, gamma=gamma,
                        is_top=True, verify_fn=self.tier_verify.get("target", rejection_sample),
                        adaptive_gamma=spec.adaptive_gamma and drafter is not None, **common)
        top.cached = reused  # prefill keeps the longest common prefix with the new prompt
        top.refeed = refeed
        return top

    def fork(self) -> "Engine":
        """An engine for one more concurrent sequence (continuous batching, ``model/batching.py``).

        It shares the models, their lower-precision copies (made once, for every fork), the settings and the test
        hooks, and has its own full KV cache, prefix tokens, placement and stats. Refused where sequences cannot
        share a forward: under tensor parallelism, and for models whose RoPE depends on the request's length
        (dynamic NTK), since a batched forward rotates every sequence with the same frequencies.

        Raises:
            ValueError: tensor parallelism, or a dynamic-NTK target or draft model.
        """
        if self.target.tp is not None:
            raise ParameterError("batched generation does not run under tensor parallelism (`tp`): use `max_batch` 1")
        for name, m in (("model", self.target), ("draft", self.draft)):
            if m is not None and m.cfg.rope_type == "dynamic":
                raise ParameterError(f"batched generation: the {name}'s RoPE is dynamic NTK, whose frequencies depend "
                                     "on each request's length; generate one prompt at a time (`max_batch` 1)")
        other = copy.copy(self)
        other._full, other._full_tokens, other._retrieval = None, [], None
        other.placement = other.last_stats = None
        return other

    # ------------------------------------------------------------------ generation
    def stream(self, prompt_ids: list[int], max_new_tokens: int = DEFAULTS["max_new_tokens"],
               sampling: SamplingParams = SamplingParams(), spec: SpeculationConfig = SpeculationConfig(),
               seed: int | None = None, prefill_progress: Callable[[int], None] | None = None,
               constraint=None) -> Generator[int, None, GenerationStats]:
        """Generate, yielding each token id as the verifier accepts it; returns the stats.

        Args:
            prompt_ids: the prompt, token ids. max_new_tokens: at most this many tokens are generated (>= 1). sampling:
            temperature / top-k / top-p (identical in every tier). spec: the speculation mode and its parameters. seed:
            seeds the generator that drives every random draw (None: a random seed, reported in the stats).
            prefill_progress: called with the number of prompt tokens each prefill chunk processed. constraint: a
            :class:`~triforce.speculation.grammar.TokenConstraint` every tier masks its logits with
                (structured output, ``speculation/grammar.py``), fresh for this generation; None: unconstrained.

        Returns (as the generator's return value, also in ``self.last_stats``): :class:`GenerationStats`.
        Closing the generator early (stop string, Ctrl-C) still records the stats, with ``finish_reason``
        ``"stop"`` or ``"interrupted"`` set by the caller through :meth:`GenerationStats` afterwards.

        Raises:
            ValueError, InsufficientMemoryError: see :meth:`plan` (raised before anything is allocated).
        """
        if isinstance(prompt_ids, (str, bytes)) or not hasattr(prompt_ids, "__iter__"):
            raise ValueError(f"prompt_ids must be a list of token ids (int), got {type(prompt_ids).__name__}")
        prompt_ids = list(prompt_ids)
        plan = self.plan(prompt_ids, max_new_tokens, spec, sampling=sampling, seed=seed)
        spec, auto = plan.spec, plan.auto
        self.last_stats = None
        if seed is None:
            seed = int.from_bytes(os.urandom(4), "little")
            if self.target.tp is not None:  # every rank draws from rank 0's seed
                seed = self.target.tp.broadcast_int(seed)
        generator = torch.Generator(device=self.target.device).manual_seed(seed)
        self.placement = plan.placement  # this request's placement, reported in its stats
        top = self.build_hierarchy(plan, sampling, generator)
        if constraint is not None:
            constraint.begin(len(prompt_ids))
            top.set_constraint(constraint)
        self.logprob_log = top.logprob_log  # the verifier's (only with sampling.logprobs); the tiers are not kept
        governor = self.governor_factory(top) if auto is not None else None
        eos = frozenset(self.eos_ids)
        t_start = t_prefill = time.perf_counter()
        seq = list(prompt_ids)
        generated, finish = 0, "length"
        stats = None
        try:
            top.prefill(prompt_ids, prefill_progress)
            t_prefill = time.perf_counter()
            while generated < max_new_tokens and finish == "length":
                if governor is not None:
                    governor.before_step(seq)
                    t_step = time.perf_counter()
                tokens, _ = top.step(seq, max_new_tokens - generated)
                for t in tokens:
                    seq.append(t)
                    generated += 1
                    yield t
                    if t in eos:
                        finish = "eos"
                        break
                top.commit(seq)
                if governor is not None:
                    governor.after_step(time.perf_counter() - t_step, len(tokens))
        except GeneratorExit:
            finish = "stop"
            raise
        except KeyboardInterrupt:
            finish = "interrupted"
            raise
        finally:
            t_end = time.perf_counter()
            t_prefill = t_prefill if generated or finish != "interrupted" else t_end  # interrupted in prefill
            for tier_stats in top.all_stats():  # nothing past the output (stop string mid-block) is counted
                tier_stats.discount_past(len(seq))
            stats = self._stats(top, spec, len(prompt_ids), generated, finish, t_prefill - t_start,
                                t_end - t_prefill, seed)
            if auto is not None:
                stats.mode = "auto"
                stats.auto = dict(hierarchy=auto.tiers or "autoregressive", budget=auto.budget, reason=auto.reason,
                                  **governor.to_dict())
            self.last_stats = stats
            top.truncate(len(seq) - 1)  # nothing past the output (e.g. drafts after an accepted EOS) stays cached
            self._full_tokens = top.cached
        return stats

    def generate(self, prompt_ids: list[int], **kwargs) -> tuple[list[int], GenerationStats]:
        """Non-streaming :meth:`stream`: returns ``(token_ids, stats)``."""
        gen = self.stream(prompt_ids, **kwargs)
        out: list[int] = []
        while True:
            try:
                out.append(next(gen))
            except StopIteration as stop:
                return out, stop.value

    def _stats(self, top: ModelTier, spec: SpeculationConfig, prompt_tokens: int, generated: int, finish: str,
               prefill_s: float, decode_s: float, seed: int) -> GenerationStats:
        tiers = {s.name: s.to_dict() for s in top.all_stats()}
        holds_all = None  # retrieval modes: at the end, the retrieval cache still holds every position
        node = top.drafter
        while node is not None:
            if isinstance(node, RetrievalTier):
                holds_all = node.cache.holds_everything
            node = getattr(node, "drafter", None)
        return GenerationStats(
            mode=spec.name, prompt_tokens=prompt_tokens, generated_tokens=generated, finish_reason=finish,
            prefill_seconds=round(prefill_s, 6), decode_seconds=round(decode_s, 6),
            decode_tokens_per_second=round(generated / decode_s, 4) if decode_s > 0 else 0.0,
            mean_time_between_tokens_ms=round(1000 * decode_s / generated, 4) if generated else 0.0,
            peak_memory_bytes=peak_memory_bytes(self.target.device), seed=seed, tiers=tiers,
            retrieval_holds_full_cache=holds_all,
            kv_placement=dict(self.placement.to_dict(), streamed_bytes=self._full.streamed_bytes)
            if self.offload_kv and self.placement is not None and self._full is not None else None,
        )
