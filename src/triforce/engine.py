"""The engine: builds the tier hierarchy for a mode, prefills, runs the decode loop, measures.

Modes (all lossless; see ``tiers.py`` for the tiers):

================  =====================================================================
``autoregressive`` target + full cache, one token per forward
``retrieval``      target + retrieval cache drafts gamma2 tokens for target + full cache
``draft``          draft model + StreamingLLM cache drafts gamma2 tokens for target + full
``triforce``       draft drafts gamma1 for target + retrieval, which drafts gamma2 for target + full
``auto``           one of the above, chosen per request, bypassed while it does not pay (``auto.py``)
================  =====================================================================

The bottom drafter of ``draft`` and ``triforce`` is a draft model, the model-free n-gram drafter (``ngram``), or
the target drafting for itself (``self``: its weights quantized to int4 over a StreamingLLM cache, QuantSpec-style,
arXiv 2502.10424), so every model gets all three tiers without a second model.

:meth:`Engine.stream` is a generator that yields token ids as the verifier accepts them and returns
:class:`GenerationStats`; :meth:`Engine.generate` is the non-streaming call.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Generator

import torch

from .auto import SpeedGovernor, plan_hierarchy
from .caches import CHUNK_SCORES, FullKVCache, RetrievalCache, StreamingCache, kv_bytes
from .memory import KVPlacement, check_fits, peak_memory_bytes, plan_kv_placement
from .model import Transformer
from .sampling import SamplingParams
from .tiers import ModelTier, RetrievalTier, StreamingTier, VerifyFn
from .ngram import NGramDrafter
from .parallel import agree_on_fit
from .speculative import rejection_sample

MODES = ("auto", "autoregressive", "retrieval", "draft", "triforce")
KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TIER_KINDS = ("ngram", "self", "draft", "retrieval")
#: the bottom tier of the ``draft``/``triforce`` presets for each ``SpeculationConfig.drafter``
DRAFTER_KINDS = {"model": "draft", "ngram": "ngram", "self": "self"}
#: weights of the ``self`` tier (the target's own weights, quantized; see ``quant.py``)
SELF_WEIGHTS = ("int4", "int8", "bfloat16")
MAX_SEED = 2**63 - 1  # seeds are in [0, MAX_SEED]: torch.Generator.manual_seed takes a non-negative int64


def _positive_int(name: str, value, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class SpeculationConfig:
    """How tokens are speculated (TriForce, arXiv 2404.11912, Sec. 4; defaults from the paper's on-chip runs).

    Attributes:
        mode: one of :data:`MODES`.
        gamma1: tokens the draft proposes per retrieval-tier verification (``triforce`` mode).
        gamma2: tokens proposed per target verification by the tier just below the target.
        budget: retrieval cache slots per layer and KV head (chunk 0 + selected chunks + generated tokens).
        chunk_size: tokens per retrieval chunk.
        rebuild_every: re-select the retrieval chunks every N generated tokens (None: only when full).
        draft_sink: StreamingLLM attention-sink tokens of the draft cache.
        draft_window: StreamingLLM recent-window tokens of the draft cache.
        drafter: bottom tier of the ``draft`` and ``triforce`` presets: ``model`` (the draft model), ``ngram`` or
            ``self`` (the target's own weights as ``self_weights``, over a StreamingLLM cache of ``draft_sink`` +
            ``draft_window`` tokens).
        self_weights: weights of the ``self`` tier, one of :data:`SELF_WEIGHTS` (default ``int4``).
        ngram_n: longest suffix the n-gram drafter matches.
        ngram_min: shortest suffix the n-gram drafter may match (>= 1; capped at ngram_n; default 3, measured
            best on 4 books x 2 prompt kinds in ``bench/beyond.py``, docs/benchmarks.md).
        stop_below: model drafters end a proposal before a token whose confidence (max probability at temperature
            1) is below this (None: fixed-length proposals).
        adaptive_gamma: each verifying tier adapts its gamma from the last block: +1 after a fully accepted block
            (up to twice the configured gamma), -1 when fewer than half were accepted.
        rebuild_below: re-select the retrieval chunks when the acceptance of the retrieval tier's last 16 proposed
            tokens falls below this fraction (None: off).
        chunk_score: retrieval chunk score, one of ``mean`` (the paper's), ``max``, ``bound``, ``attn`` (see
            :class:`~triforce.retrieval.RetrievalCache`).
        lower_weights: weights of the tiers below the verifier (the retrieval tier's copy of the target, and the
            draft model): None (as loaded), ``int8`` (weight-only) or ``bfloat16`` (see ``quant.py``). Lossless:
            the verifier decides every token; only acceptance can change.
        lower_kv_dtype: dtype of the retrieval and draft caches: None (as the model), ``bfloat16`` or ``float16``.
        tiers: an explicit hierarchy under the full-cache target, bottom first, ``kind:gamma`` entries with kind in
            :data:`TIER_KINDS` (``ngram`` only at the bottom), e.g. ``"self:4,retrieval:6"``: each gamma is
            how many tokens that tier proposes per verification by the tier above. Overrides ``mode``.

    Raises:
        ValueError: (on construction) a value outside its range, naming the parameter and the allowed values.
    """

    mode: str = "autoregressive"
    gamma1: int = 4
    gamma2: int = 6
    budget: int = 4096
    chunk_size: int = 8
    rebuild_every: int | None = None
    draft_sink: int = 16
    draft_window: int = 240
    drafter: str = "model"
    self_weights: str = "int4"
    ngram_n: int = 4
    ngram_min: int = 3
    chunk_score: str = "mean"
    rebuild_below: float | None = None
    stop_below: float | None = None
    adaptive_gamma: bool = False
    lower_weights: str | None = None
    lower_kv_dtype: str | None = None
    tiers: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.drafter not in DRAFTER_KINDS:
            raise ValueError(f"drafter must be one of {', '.join(DRAFTER_KINDS)}, got {self.drafter!r}")
        if self.self_weights not in SELF_WEIGHTS:
            raise ValueError(f"self_weights must be one of {', '.join(SELF_WEIGHTS)}, got {self.self_weights!r}")
        _positive_int("ngram_n", self.ngram_n)
        _positive_int("ngram_min", self.ngram_min)
        if self.chunk_score not in CHUNK_SCORES:
            raise ValueError(f"chunk_score must be one of {', '.join(CHUNK_SCORES)}, got {self.chunk_score!r}")
        chain = self.chain  # parses and checks `tiers`
        _positive_int("gamma1", self.gamma1)
        _positive_int("gamma2", self.gamma2)
        _positive_int("chunk_size", self.chunk_size)
        _positive_int("budget", self.budget)
        if self.rebuild_every is not None:
            _positive_int("rebuild_every", self.rebuild_every)
        if self.rebuild_below is not None and not (isinstance(self.rebuild_below, (int, float))
                                                   and 0 < self.rebuild_below <= 1):
            raise ValueError(f"rebuild_below must be in (0, 1], got {self.rebuild_below!r}")
        if not isinstance(self.adaptive_gamma, bool):
            raise ValueError(f"adaptive_gamma must be True or False, got {self.adaptive_gamma!r}")
        if self.stop_below is not None and not (isinstance(self.stop_below, (int, float)) and 0 < self.stop_below < 1):
            raise ValueError(f"stop_below must be in (0, 1), got {self.stop_below!r}")
        if self.lower_weights not in (None, "int8", "int4", "bfloat16"):
            raise ValueError(f"lower_weights must be None, 'int8', 'int4' or 'bfloat16', got {self.lower_weights!r}")
        if self.lower_kv_dtype not in (None, *KV_DTYPES):
            raise ValueError(f"lower_kv_dtype must be None or one of {', '.join(KV_DTYPES)}, got {self.lower_kv_dtype!r}")
        _positive_int("draft_sink", self.draft_sink, 0)
        _positive_int("draft_window", self.draft_window)
        for i, (kind, _) in enumerate(self.chain):
            # chunk 0 + the block the retrieval tier may run ahead (gamma + 1) + the verifier's newest token
            gamma = self.reach(i)
            if kind == "retrieval" and self.budget < self.chunk_size + gamma + 2:
                raise ValueError(f"budget must be >= chunk_size + gamma + 2 = {self.chunk_size + gamma + 2} "
                                 f"(chunk 0 plus room for a speculation block of {gamma} tokens), got {self.budget}: "
                                 "raise --budget or lower --chunk-size / the gamma of the retrieval tier and the tiers "
                                 "above it")

    @property
    def chain(self) -> list[tuple[str, int]]:
        """The hierarchy under the full-cache target, bottom first: ``[(kind, gamma), ...]``.

        Raises:
            ValueError: a malformed ``tiers`` string (the allowed kinds are in the message).
        """
        bottom = DRAFTER_KINDS[self.drafter]
        if self.tiers is None:
            return {"auto": [], "autoregressive": [], "retrieval": [("retrieval", self.gamma2)], "draft": [(bottom, self.gamma2)],
                    "triforce": [(bottom, self.gamma1), ("retrieval", self.gamma2)]}[self.mode]
        chain = []
        for entry in str(self.tiers).split(","):
            kind, _, gamma = entry.strip().partition(":")
            if kind not in TIER_KINDS or not gamma.strip().isdigit() or int(gamma) < 1:
                raise ValueError(f"tiers entries must be KIND:GAMMA with KIND in {', '.join(TIER_KINDS)} and GAMMA >= 1, "
                                 f"bottom first (e.g. self:4,retrieval:6); got {entry.strip()!r}")
            chain.append((kind, int(gamma)))
        kinds = [k for k, _ in chain]
        if "ngram" in kinds[1:] or len(set(kinds)) != len(kinds):
            raise ValueError(f"tiers: each kind at most once and ngram only at the bottom, got {self.tiers!r}")
        return chain

    @property
    def max_chain(self) -> list[tuple[str, int]]:
        """:attr:`chain` with each gamma at the largest value it can reach (twice it with ``adaptive_gamma``)."""
        return [(k, 2 * g if self.adaptive_gamma else g) for k, g in self.chain]

    def resolve_auto(self, plan) -> "SpeculationConfig":
        """This config with ``mode='auto'`` replaced by the hierarchy of an :class:`~triforce.auto.AutoPlan`."""
        if self.mode != "auto" or self.tiers is not None:
            return self
        return replace(self, mode="autoregressive", tiers=plan.tiers or None, budget=plan.budget,
                       lower_weights=self.lower_weights or plan.lower_weights)

    def reach(self, index: int) -> int:
        """Most tokens the tier at ``index`` of :attr:`chain` may run ahead of the committed sequence.

        A tier proposes continuations of the unverified tokens of the tiers above it, so its reach is not its own gamma
        but the largest gamma (at its adaptive maximum, :attr:`max_chain`) of that tier and every tier above it; the
        verifier's block bounds them all. Used for the retrieval tier's budget check and rebuild lookahead.

        Raises:
            IndexError: ``index`` outside :attr:`chain`.
        """
        chain = self.max_chain
        if not 0 <= index < len(chain):
            raise IndexError(f"index must be in [0, {len(chain)}), got {index}")
        return max(g for _, g in chain[index:])

    @property
    def name(self) -> str:
        """The mode, or the explicit tier string."""
        return self.mode if self.tiers is None else "tiers:" + ",".join(f"{k}:{g}" for k, g in self.chain)

    @property
    def uses_draft(self) -> bool:
        """The hierarchy has a draft-model tier (needs a draft model)."""
        return any(k == "draft" for k, _ in self.chain)

    @property
    def uses_retrieval(self) -> bool:
        """The hierarchy has a retrieval-cache tier."""
        return any(k == "retrieval" for k, _ in self.chain)


@dataclass
class GenerationStats:
    """Figures of one generation (schema documented in README.md, "JSON output").

    Times are seconds, rates tokens per second, memory bytes.
    """

    mode: str
    prompt_tokens: int
    generated_tokens: int
    finish_reason: str
    prefill_seconds: float
    decode_seconds: float
    decode_tokens_per_second: float
    mean_time_between_tokens_ms: float
    peak_memory_bytes: int
    seed: int
    tiers: dict = field(default_factory=dict)
    retrieval_holds_full_cache: bool | None = None
    kv_placement: dict | None = None
    auto: dict | None = None

    def to_dict(self) -> dict:
        """All fields as a JSON-ready dict."""
        return asdict(self)

    def summary(self) -> str:
        """One line: speed, then acceptance per verifying tier."""
        def tokens(n: int) -> str:
            return f"{n} token{'' if n == 1 else 's'}"

        mode = self.mode if not self.auto else f"auto ({self.auto['hierarchy']}, " \
            f"{self.auto['speculative_tokens']} speculative / {self.auto['autoregressive_tokens']} plain tokens)"
        parts = [f"{mode}: {tokens(self.generated_tokens)}, {self.decode_tokens_per_second:.2f} tok/s, "
                 f"TBT {self.mean_time_between_tokens_ms:.1f} ms, prefill {self.prefill_seconds:.2f} s "
                 f"({tokens(self.prompt_tokens)})"]
        for name, t in self.tiers.items():
            if t.get("verifications"):
                parts.append(f"{name}: acceptance {t['acceptance_rate']:.3f}, "
                             f"{t['mean_tokens_per_verification']:.2f} tokens/verification")
        if self.retrieval_holds_full_cache:
            parts.append("retrieval cache = whole cache (everything fit in the budget)")
        return "; ".join(parts)


class Engine:
    """Runs generation for a target model and an optional draft model.

    Args:
        target: the target model (tiers 1 and 2 share its weights).
        draft: a small model with the same tokenizer, for the ``draft`` and ``triforce`` modes.
        eos_ids: tokens that end generation.
        reuse_prefix: keep the full KV cache between requests and prefill only what follows the longest common
            prefix of the new prompt with the previous request's tokens (multi-turn chat over a long document).
        offload_kv: keep the verifier's full KV cache in host memory and stream it to the device layer by layer
            with one layer of prefetch (:class:`~triforce.caches.FullKVCache`); the retrieval and draft caches stay
            on the device.
        on_chip_layers: with ``offload_kv``, leading layers kept on the device (None: the memory planner chooses
            from free device memory, :func:`~triforce.memory.plan_kv_placement`).
        kv_dtype: dtype of every KV cache (``float32``, ``bfloat16``, ``float16``; None: the target's dtype). The
            full cache's dtype is the verifier's, so it changes the output distribution like ``--dtype`` does;
            ``SpeculationConfig.lower_kv_dtype`` changes only the lower tiers' caches, at no loss.

    ``tier_verify`` maps a tier name to a replacement verification rule (tests inject broken variants);
    ``governor_factory(top)`` makes the :class:`~triforce.auto.SpeedGovernor` of an ``auto`` request (tests inject
    scripted ones).
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
            raise ValueError(f"on_chip_layers must be an integer in [0, {L}] and needs offload_kv, got {on_chip_layers!r}")
        self.offload_kv, self.on_chip_layers = offload_kv, on_chip_layers
        self.placement: KVPlacement | None = None  # the offloading plan of the request running (or the last one)
        self.eos_ids = tuple(eos_ids)
        self.last_stats: GenerationStats | None = None
        # prefix reuse: the verifier's full cache and the tokens it holds, kept from the previous request
        self._full: FullKVCache | None = None
        self._full_tokens: list[int] = []
        self.tier_verify: dict[str, VerifyFn] = {}  # per-tier override of the verification rule (tests)
        self.governor_factory: Callable = SpeedGovernor  # mode auto: decides when to bypass the drafters (tests swap it)

    # ------------------------------------------------------------------ planning
    def cache_bytes(self, prompt_tokens: int, max_new_tokens: int, spec: SpeculationConfig) -> dict[str, int]:
        """Bytes each cache of a request would allocate, by cache."""
        dtype = self.kv_dtype
        lower = KV_DTYPES[spec.lower_kv_dtype] if spec.lower_kv_dtype else None
        out = {"full KV cache": kv_bytes(self.target.cfg, self._capacity(prompt_tokens, max_new_tokens, spec), dtype)}
        if spec.uses_retrieval:
            out["retrieval cache"] = kv_bytes(self.target.cfg, spec.budget, lower or dtype)
        if spec.uses_draft and self.draft is not None:
            out["draft cache"] = kv_bytes(self.draft.cfg, self._draft_capacity(spec), lower or self.draft.dtype)
        kinds = [k for k, _ in spec.chain]
        if "self" in kinds:
            out["self-draft cache"] = kv_bytes(self.target.cfg, self._draft_capacity(spec), lower or dtype)
        copies = [(m, spec.lower_weights) for m in ([self.target] if spec.uses_retrieval else [])
                  + ([self.draft] if spec.uses_draft and self.draft else []) if spec.lower_weights]
        copies += [(self.target, spec.self_weights)] if "self" in kinds else []
        bytes_per_weight = {"int8": 1.0, "int4": 0.625, "bfloat16": 2.0}  # int4: 4 bits + bf16 scale/zero per 32
        for m, scheme in dict.fromkeys(copies):
            if (id(m), scheme) not in self._lower:
                key = f"{scheme} copies of the lower tiers' weights"
                weights = m.weight_bytes() // m.dtype.itemsize
                out[key] = out.get(key, 0) + int(weights * bytes_per_weight[scheme])
        return out

    def _lower_model(self, model: Transformer, weights: str | None) -> Transformer:
        """``model`` itself, or its lower-precision copy for the tiers below the verifier (made once, kept)."""
        if weights is None:
            return model
        key = (id(model), weights)
        if key not in self._lower:
            from .quant import lower_precision_copy

            self._lower[key] = lower_precision_copy(model, weights)
        lower = self._lower[key]
        lower.rope = model.rope  # RoPE is fixed per request (dynamic NTK): follow the source model
        return lower

    @staticmethod
    def _capacity(prompt_tokens: int, max_new_tokens: int, spec: SpeculationConfig) -> int:
        chain = spec.max_chain
        block = chain[-1][1] if chain else 0  # the largest block the verifier checks at once
        return prompt_tokens + max_new_tokens + block + 1

    @staticmethod
    def _lookahead(spec: SpeculationConfig) -> int:
        """Most positions any tier can run ahead of the committed sequence."""
        return sum(g for _, g in spec.max_chain) + len(spec.chain) + 1

    DRAFT_PREFILL_CHUNK = 256

    def _draft_capacity(self, spec: SpeculationConfig) -> int:
        return spec.draft_sink + spec.draft_window + self._lookahead(spec) + self.DRAFT_PREFILL_CHUNK

    def plan_auto(self, prompt_tokens: int, sampling: SamplingParams, spec: SpeculationConfig):
        """The hierarchy ``mode='auto'`` runs for a prompt of ``prompt_tokens`` (:func:`~triforce.auto.plan_hierarchy`)."""
        bottom = DRAFTER_KINDS[spec.drafter] if spec.drafter != "model" or self.draft is not None else None
        return plan_hierarchy(self.target.cfg, self.target.weight_bytes(), self.kv_dtype, prompt_tokens, bottom,
                              sampling, gamma1=spec.gamma1, gamma2=spec.gamma2, chunk_size=spec.chunk_size,
                              max_budget=spec.budget)

    def validate(self, prompt_ids: list[int], max_new_tokens: int, spec: SpeculationConfig) -> KVPlacement | None:
        """Check a request before any heavy work. Side-effect free: a server may validate one request while another
        runs; :meth:`stream` stores the plan in :attr:`placement` only when its request starts.

        Returns:
            with ``offload_kv``, the offloading plan this request would get (:class:`~triforce.memory.KVPlacement`);
            otherwise None.

        Raises:
            ValueError: empty prompt, max_new_tokens < 1, a token id outside the vocabulary, a draft mode without a
                draft model, a request longer than a sliding window.
            InsufficientMemoryError: the caches do not fit in free memory (under tensor parallelism: on any rank,
                agreed by every rank, see :func:`~triforce.parallel.agree_on_fit`).
        """
        if not prompt_ids:
            raise ValueError("prompt is empty: give at least one token")
        _positive_int("max_new_tokens", max_new_tokens)
        vocab = self.target.cfg.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {vocab}), got {bad[:5]}")
        if spec.uses_draft and self.draft is None:
            raise ValueError(f"mode {spec.name!r} needs a draft model (--draft MODEL), or --draft ngram for the "
                             "model-free drafter; without one use mode 'autoregressive' or 'retrieval'")
        total = self._capacity(len(prompt_ids), max_new_tokens, spec)
        self.target.cfg.check_length(total)
        context = self.target.cfg.max_position_embeddings
        if self.target.cfg.rope_type != "dynamic" and len(prompt_ids) >= context:
            raise ValueError(f"max_prompt_tokens: the prompt has {len(prompt_ids)} tokens, not fewer than the model's "
                             f"context of {context}; keep the first N with --max-prompt-tokens N")
        if self.target.cfg.rope_type != "dynamic" and len(prompt_ids) + max_new_tokens > context:
            raise ValueError(f"max_new_tokens={max_new_tokens} with a {len(prompt_ids)}-token prompt exceeds the model's "
                             f"context of {context} tokens (max_position_embeddings)")
        return agree_on_fit(self.target.tp, lambda: self._fit(len(prompt_ids), max_new_tokens, spec, total))

    def _fit(self, prompt_tokens: int, max_new_tokens: int, spec: SpeculationConfig, total: int) -> KVPlacement | None:
        """The memory checks of :meth:`validate` on this rank; returns the offloading plan (None without offloading)."""
        needed = self.cache_bytes(prompt_tokens, max_new_tokens, spec)
        weights = {"weights": self.target.weight_bytes() + (self.draft.weight_bytes() if self.draft else 0)}
        if not self.offload_kv:
            check_fits(needed, self.target.device, "this request", already=weights)
            return None
        full = needed.pop("full KV cache")
        L = self.target.cfg.num_hidden_layers
        fixed = self.on_chip_layers
        if fixed is None and self._full is not None and self._full.offload and self._full.capacity >= total:
            fixed = self._full.on_chip_layers  # the cache kept for prefix reuse keeps its placement
        placement = plan_kv_placement(L, full // L, self.target.device, sum(needed.values()), fixed)
        on_device = dict(needed, **{"on-chip KV layers and stream buffers": placement.device_bytes})
        if self.target.device.type == "cpu":  # one memory pool
            check_fits(dict(on_device, **{"offloaded full KV cache": full}), "cpu", "this request", already=weights)
        else:
            check_fits(on_device, self.target.device, "this request", already=weights)
            check_fits({"offloaded full KV cache": full}, "cpu", "this request's host memory")
        return placement

    # ------------------------------------------------------------------ hierarchy
    def build_hierarchy(self, prompt_tokens: int, max_new_tokens: int, sampling: SamplingParams,
                        spec: SpeculationConfig, generator: torch.Generator) -> ModelTier:
        """Allocate the caches and chain the tiers for ``spec.mode``; returns the top (verifier) tier."""
        total = self._capacity(prompt_tokens, max_new_tokens, spec)
        common = dict(sampling=sampling, generator=generator, eos_ids=self.eos_ids, tp=self.target.tp)
        full, reused = self._full, list(self._full_tokens)
        placement = self.placement if self.offload_kv else None
        on_chip = placement.on_chip_layers if placement else self.target.cfg.num_hidden_layers
        moved = full is not None and (full.offload != self.offload_kv or full.on_chip_layers != on_chip)
        if full is None or not self.reuse_prefix or (full.capacity < total and self.target.cfg.rope_type == "dynamic"):
            self._full = full = None  # free the old cache before allocating the new one
            reused = []
        if full is None or full.capacity < total or moved:
            # dynamic NTK scales with the cache's capacity, so a reused cache keeps its RoPE frequencies
            if full is None:
                self.target.set_request_length(total)
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
                    self.draft.set_request_length(total)
                    d = self._lower_model(self.draft, spec.lower_weights)
                    kv = self.kv_dtype if self.draft.dtype == self.target.dtype else self.draft.dtype
                else:
                    d, kv = self._lower_model(self.target, spec.self_weights), self.kv_dtype
                kv = KV_DTYPES[spec.lower_kv_dtype] if spec.lower_kv_dtype else kv
                cache = StreamingCache(d.cfg, spec.draft_sink, spec.draft_window,
                                       self._lookahead(spec) + self.DRAFT_PREFILL_CHUNK, d.rope, kv, d.device)
                node = StreamingTier(kind, d, cache, drafter=drafter, gamma=gamma,
                                     prefill_chunk=self.DRAFT_PREFILL_CHUNK, verify_fn=verify, **adaptive, **common)
            else:
                cache = RetrievalCache(self.target.cfg, full, spec.budget, spec.chunk_size, spec.chunk_score,
                                       dtype=KV_DTYPES[spec.lower_kv_dtype] if spec.lower_kv_dtype else None)
                refeed = max(refeed, cache.query_window)  # the prompt's last forward records its query window
                node = RetrievalTier("retrieval", self._lower_model(self.target, spec.lower_weights), cache, drafter=drafter, gamma=gamma, full=full,
                                     lookahead=spec.reach(index) + 1,
                                     rebuild_every=spec.rebuild_every, rebuild_below=spec.rebuild_below,
                                     verify_fn=verify, **adaptive,
                                     **common)
            drafter, gamma = node, proposes
        top = ModelTier("target", self.target, full, drafter=drafter, gamma=gamma,
                        is_top=True, verify_fn=self.tier_verify.get("target", rejection_sample),
                        adaptive_gamma=spec.adaptive_gamma and drafter is not None, **common)
        top.cached = reused  # prefill keeps the longest common prefix with the new prompt
        top.refeed = refeed
        return top

    # ------------------------------------------------------------------ generation
    def stream(self, prompt_ids: list[int], max_new_tokens: int = 256, sampling: SamplingParams = SamplingParams(),
               spec: SpeculationConfig = SpeculationConfig(), seed: int | None = None,
               prefill_progress: Callable[[int], None] | None = None) -> Generator[int, None, GenerationStats]:
        """Generate, yielding each token id as the verifier accepts it; returns the stats.

        Args:
            prompt_ids: the prompt, token ids.
            max_new_tokens: at most this many tokens are generated (>= 1).
            sampling: temperature / top-k / top-p (identical in every tier).
            spec: the speculation mode and its parameters.
            seed: seeds the generator that drives every random draw (None: a random seed, reported in the stats).
            prefill_progress: called with the number of prompt tokens each prefill chunk processed.

        Returns (as the generator's return value, also in ``self.last_stats``): :class:`GenerationStats`.
        Closing the generator early (stop string, Ctrl-C) still records the stats, with ``finish_reason``
        ``"stop"`` or ``"interrupted"`` set by the caller through :meth:`GenerationStats` afterwards.

        Raises:
            ValueError, InsufficientMemoryError: see :meth:`validate` (raised before anything is allocated).
        """
        if isinstance(prompt_ids, (str, bytes)) or not hasattr(prompt_ids, "__iter__"):
            raise ValueError(f"prompt_ids must be a list of token ids (int), got {type(prompt_ids).__name__}")
        prompt_ids = list(prompt_ids)
        if any(isinstance(t, bool) or not isinstance(t, int) for t in prompt_ids):
            bad = next(t for t in prompt_ids if isinstance(t, bool) or not isinstance(t, int))
            raise ValueError(f"prompt_ids must be token ids (int), got {bad!r}")
        if not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        if not isinstance(spec, SpeculationConfig):
            raise ValueError(f"spec must be a SpeculationConfig, got {type(spec).__name__}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED):
            raise ValueError(f"seed must be an integer in [0, 2**63 - 1], got {seed!r}")
        self.last_stats = None
        plan = None
        if spec.mode == "auto" and spec.tiers is None:
            plan = self.plan_auto(len(prompt_ids), sampling, spec)
            spec = spec.resolve_auto(plan)
        placement = self.validate(prompt_ids, max_new_tokens, spec)
        if seed is None:
            seed = int.from_bytes(os.urandom(4), "little")
            if self.target.tp is not None:  # every rank draws from rank 0's seed
                seed = self.target.tp.broadcast_int(seed)
        generator = torch.Generator(device=self.target.device).manual_seed(seed)
        self.placement = placement  # this request's plan, reported in its stats
        top = self.build_hierarchy(len(prompt_ids), max_new_tokens, sampling, spec, generator)
        governor = self.governor_factory(top) if plan is not None else None
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
            stats = self._stats(top, spec, len(prompt_ids), generated, finish, t_prefill - t_start, t_end - t_prefill, seed)
            if plan is not None:
                stats.mode = "auto"
                stats.auto = dict(hierarchy=plan.tiers or "autoregressive", budget=plan.budget, reason=plan.reason,
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
