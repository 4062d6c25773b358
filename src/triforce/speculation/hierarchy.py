"""The canonical description of a speculation hierarchy: a list of tier specs, and the presets that expand to one.

A hierarchy is the chain of tiers under the verifier (the target over its full KV cache), bottom first. Each tier
is a :class:`TierSpec`: its kind (:data:`TIER_KINDS`), its gamma (tokens it proposes per verification by the tier
above) and that kind's own options (:data:`KIND_OPTIONS`). :class:`SpeculationConfig` holds the user's settings;
its ``mode`` names are presets (:data:`PRESETS`) that expand to a chain, ``tiers`` gives one explicitly, and
``auto`` chooses one per request (``speculation/auto.py``). An option that the hierarchy cannot use is reported by
:meth:`SpeculationConfig.unused_options` with the reason, so that the command line refuses it before anything
loads. Every default comes from :data:`triforce.defaults.DEFAULTS`.

======================  ===============================================================  =====================
preset (``--mode``)     chain under the target, bottom first                             gammas
======================  ===============================================================  =====================
``autoregressive``      (none)                                                           -
``retrieval``           retrieval                                                        gamma2
``draft``               drafter (``draft`` model, ``ngram`` or ``self``)                 gamma2
``triforce``            drafter, retrieval                                               gamma1, gamma2
``auto``                chosen per request (``auto.choose_hierarchy``)                   gamma1, gamma2
======================  ===============================================================  =====================
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Iterable, Mapping

from ..defaults import DEFAULTS, DTYPE_ALIASES, LIBRARY_MODE, LOWER_WEIGHTS, SELF_WEIGHTS
from ..errors import ParameterError
from ..kv.retrieval import CHUNK_SCORES

MODES = ("auto", "autoregressive", "retrieval", "draft", "triforce")
TIER_KINDS = ("ngram", "self", "draft", "retrieval")
#: the bottom tier of the ``draft``/``triforce`` presets for each ``SpeculationConfig.drafter``
DRAFTER_KINDS = {"model": "draft", "ngram": "ngram", "self": "self"}
#: preset -> chain of (kind, gamma option), bottom first; ``drafter`` stands for the ``drafter`` setting's kind
PRESETS: dict[str, tuple[tuple[str, str], ...]] = {
    "autoregressive": (),
    "retrieval": (("retrieval", "gamma2"),),
    "draft": (("drafter", "gamma2"),),
    "triforce": (("drafter", "gamma1"), ("retrieval", "gamma2")),
}
#: each tier kind's own options (``SpeculationConfig`` field names)
KIND_OPTIONS: dict[str, tuple[str, ...]] = {
    "ngram": ("ngram_n", "ngram_min"),
    "self": ("self_weights", "draft_sink", "draft_window", "lower_kv_dtype", "stop_below"),
    "draft": ("draft_sink", "draft_window", "lower_weights", "lower_kv_dtype", "stop_below"),
    "retrieval": ("budget", "chunk_size", "chunk_score", "rebuild_every", "rebuild_below", "lower_weights",
                  "lower_kv_dtype", "stop_below"),
}
#: options of the hierarchy as a whole, and who uses them (the reason given when one is refused)
HIERARCHY_OPTIONS: dict[str, str] = {
    "gamma1": "the bottom tier's gamma of --mode triforce (with --tiers, each entry gives its gamma)",
    "gamma2": "the gamma of the tier under the target in the retrieval, draft and triforce modes (with --tiers, "
              "each entry gives its gamma)",
    "adaptive_gamma": "a hierarchy with at least one tier under the target",
}
MAX_SEED = 2**63 - 1  # seeds are in [0, MAX_SEED]: torch.Generator.manual_seed takes a non-negative int64


def gamma_cap(max_new_tokens: int) -> int:
    """The most proposals a verification of a request of ``max_new_tokens`` tokens can use: ``max_new_tokens - 1``,
    at least 1 (a verification emits at most the tokens left; ``ModelTier.step`` never asks for more)."""
    return max(1, max_new_tokens - 1)


def _positive_int(name: str, value, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ParameterError(f"`{name}` must be an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class TierSpec:
    """One tier of a hierarchy.

    Attributes:
        kind: one of :data:`TIER_KINDS`.
        gamma: tokens this tier proposes per verification by the tier above (>= 1).
        options: this kind's own options (:data:`KIND_OPTIONS`), name -> value.
    """

    kind: str
    gamma: int
    options: Mapping[str, object] = field(default_factory=dict)


def _d(name: str):
    return field(default=DEFAULTS[name])


@dataclass(frozen=True)
class SpeculationConfig:
    """How tokens are speculated (TriForce, arXiv 2404.11912, Sec. 4; defaults from the paper's on-chip runs).

    Attributes:
        mode: one of :data:`MODES`.
        gamma1: tokens the draft proposes per retrieval-tier verification (``triforce`` mode).
        gamma2: tokens proposed per target verification by the tier just below the target. Every gamma (these
            two and each of ``tiers``) is capped per request at what it can use, ``max_new_tokens - 1`` (at least
            1: :meth:`for_request`), and the caches are sized for the capped value; the stats report the gamma
            each verifying tier ran with.
        budget: retrieval cache slots per layer and KV head (chunk 0 + selected chunks + generated tokens), at
            least ``chunk_size + gamma + 2`` for a retrieval tier; with ``auto`` a pinned budget is honoured: its
            retrieval tier takes at most ``budget`` slots and at least ``chunk_size + gamma2 + 2`` (twice gamma2
            with ``adaptive_gamma``), so a smaller budget is refused.
        chunk_size: tokens per retrieval chunk.
        rebuild_every: re-select the retrieval chunks every N generated tokens (None: only when full).
        draft_sink: StreamingLLM attention-sink tokens of the draft cache.
        draft_window: StreamingLLM recent-window tokens of the draft cache.
        drafter: bottom tier of the ``draft`` and ``triforce`` presets: ``model`` (the draft model), ``ngram`` or
            ``self`` (the target's own weights as ``self_weights``, over a StreamingLLM cache of ``draft_sink`` +
            ``draft_window`` tokens).
        self_weights: weights of the ``self`` tier, one of :data:`SELF_WEIGHTS` (default ``int4``).
        ngram_n: longest suffix the n-gram drafter matches.
        ngram_min: shortest suffix the n-gram drafter may match (>= 1; capped at ngram_n).
        stop_below: model drafters end a proposal before a token whose confidence (max probability at temperature
            1) is below this (None: fixed-length proposals).
        adaptive_gamma: each verifying tier adapts its gamma from the last block: +1 after a fully accepted block
            (up to twice the configured gamma), -1 when fewer than half were accepted.
        rebuild_below: re-select the retrieval chunks when the acceptance of the retrieval tier's last 16 proposed
            tokens falls below this fraction (None: off).
        chunk_score: retrieval chunk score, one of ``mean`` (the paper's), ``max``, ``bound``, ``attn`` (see
            :class:`~triforce.kv.retrieval.RetrievalCache`).
        lower_weights: weights of the tiers below the verifier (the retrieval tier's copy of the target, and the
            draft model): None (as loaded), ``int8`` (weight-only), ``int4``, ``bfloat16`` or ``codes`` (a GGUF
            model's own block codes times int8-quantized activations; int8 for a model without codes) (see
            ``model/quant.py``). Lossless: the verifier decides every token; only acceptance can change.
        lower_kv_dtype: dtype of the retrieval and draft caches: None (as the full cache; ``auto`` may pick
            ``bfloat16`` for its retrieval tier), ``bfloat16``, ``float16`` or ``float32``, or the command line's
            short names ``bf16``, ``fp16``, ``fp32`` (:data:`~triforce.defaults.DTYPE_ALIASES`; kept as the full name).
        tiers: an explicit hierarchy under the full-cache target, bottom first, ``kind:gamma`` entries with kind in
            :data:`TIER_KINDS` (``ngram`` only at the bottom), e.g. ``"self:4,retrieval:6"``: each gamma is
            how many tokens that tier proposes per verification by the tier above. Overrides ``mode``.

    Raises:
        ValueError: (on construction) a value outside its range, naming the parameter and the allowed values
            (a :class:`~triforce.errors.ParameterError`: the command line spells the names as its flags).
    """

    mode: str = LIBRARY_MODE
    gamma1: int = _d("gamma1")
    gamma2: int = _d("gamma2")
    budget: int = _d("budget")
    chunk_size: int = _d("chunk_size")
    rebuild_every: int | None = _d("rebuild_every")
    draft_sink: int = _d("draft_sink")
    draft_window: int = _d("draft_window")
    drafter: str = "model"
    self_weights: str = _d("self_weights")
    ngram_n: int = _d("ngram_n")
    ngram_min: int = _d("ngram_min")
    chunk_score: str = _d("chunk_score")
    rebuild_below: float | None = _d("rebuild_below")
    stop_below: float | None = _d("stop_below")
    adaptive_gamma: bool = _d("adaptive_gamma")
    lower_weights: str | None = _d("lower_weights")
    lower_kv_dtype: str | None = _d("lower_kv_dtype")
    tiers: str | None = _d("tiers")

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
        _ = self.chain  # parses and checks `tiers`
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
        if self.lower_weights not in (None, *LOWER_WEIGHTS):
            raise ValueError(f"lower_weights must be None or one of {', '.join(LOWER_WEIGHTS)}, "
                             f"got {self.lower_weights!r}")
        if self.lower_kv_dtype is not None and (not isinstance(self.lower_kv_dtype, str)
                                                or self.lower_kv_dtype not in DTYPE_ALIASES):
            raise ParameterError(f"`lower_kv_dtype` must be None or one of {', '.join(DTYPE_ALIASES)}, "
                                 f"got {self.lower_kv_dtype!r}")
        if self.lower_kv_dtype is not None:  # one spelling downstream: bf16 -> bfloat16
            object.__setattr__(self, "lower_kv_dtype", DTYPE_ALIASES[self.lower_kv_dtype])
        _positive_int("draft_sink", self.draft_sink, 0)
        _positive_int("draft_window", self.draft_window)
        # chunk 0 + the block the retrieval tier may run ahead (gamma + 1) + the verifier's newest token; auto's
        # retrieval tier (directly under the target) runs gamma2 ahead: a budget it cannot honour is refused here
        reaches = [(self.reach(i), "the gammas of `tiers` from the retrieval tier up" if self.tiers else
                    "`gamma2`") for i, (kind, _) in enumerate(self.chain) if kind == "retrieval"]
        if self.chooses_per_request:
            reaches.append((2 * self.gamma2 if self.adaptive_gamma else self.gamma2, "`gamma2`"))
        where = " in a retrieval tier auto may choose" if self.chooses_per_request else ""
        for gamma, which in reaches:
            if self.budget < self.chunk_size + gamma + 2:
                raise ParameterError(
                    f"`budget` must be >= `chunk_size` + gamma + 2 = {self.chunk_size + gamma + 2} (chunk 0 plus room "
                    f"for a speculation block of {gamma} tokens{where}), got {self.budget}: raise `budget` or lower "
                    f"`chunk_size` / {which}")

    @property
    def chain(self) -> list[tuple[str, int]]:
        """The hierarchy under the full-cache target, bottom first: ``[(kind, gamma), ...]``.

        Raises:
            ValueError: a malformed ``tiers`` string (the allowed kinds are in the message).
        """
        if self.tiers is None:  # a preset (``auto`` before it is resolved: no tier yet)
            bottom = DRAFTER_KINDS[self.drafter]
            return [(bottom if kind == "drafter" else kind, getattr(self, gamma))
                    for kind, gamma in PRESETS.get(self.mode, ())]
        chain = []
        for entry in str(self.tiers).split(","):
            kind, _, gamma = entry.strip().partition(":")
            if kind not in TIER_KINDS or not (gamma.strip().isascii() and gamma.strip().isdigit()) or int(gamma) < 1:
                raise ValueError(f"tiers entries must be KIND:GAMMA with KIND in {', '.join(TIER_KINDS)} and "
                                 f"GAMMA >= 1, bottom first (e.g. self:4,retrieval:6); got {entry.strip()!r}")
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
        """This config with ``mode='auto'`` replaced by the hierarchy of an :class:`~.auto.AutoPlan`."""
        if self.mode != "auto" or self.tiers is not None:
            return self
        return replace(self, mode="autoregressive", tiers=plan.tiers or None, budget=plan.budget or self.budget,
                       lower_weights=self.lower_weights or plan.lower_weights,
                       lower_kv_dtype=self.lower_kv_dtype or plan.lower_kv_dtype)

    def for_request(self, max_new_tokens: int) -> "SpeculationConfig":
        """This config with every gamma (``gamma1``, ``gamma2``, each of ``tiers``) capped at what a request of
        ``max_new_tokens`` tokens can use: ``max_new_tokens - 1``, at least 1. A verification emits at most the
        tokens left, so no tier is ever asked for more proposals (``ModelTier.step``): the output is the same, and
        the caches are sized for the capped gammas, not for a huge one (``Engine.plan`` applies it). Itself when
        nothing is capped.

        Raises:
            ValueError: ``max_new_tokens`` is not an integer >= 1.
        """
        _positive_int("max_new_tokens", max_new_tokens)
        cap = gamma_cap(max_new_tokens)
        if max(self.gamma1, self.gamma2, *(g for _, g in self.chain)) <= cap:
            return self
        tiers = None if self.tiers is None else ",".join(f"{k}:{min(g, cap)}" for k, g in self.chain)
        return replace(self, gamma1=min(self.gamma1, cap), gamma2=min(self.gamma2, cap), tiers=tiers)

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


    @property
    def tier_specs(self) -> tuple[TierSpec, ...]:
        """The hierarchy as tier specs, bottom first: each tier's kind, gamma and its kind's own options."""
        return tuple(TierSpec(kind, gamma, {name: getattr(self, name) for name in KIND_OPTIONS[kind]})
                     for kind, gamma in self.chain)

    @property
    def chooses_per_request(self) -> bool:
        """``mode='auto'`` without ``tiers``: the hierarchy is chosen per request, so every option may be used."""
        return self.mode == "auto" and self.tiers is None

    def option_users(self) -> dict[str, str]:
        """Every option of this config that a hierarchy may use -> who uses it (a phrase, for messages)."""
        kinds: dict[str, list[str]] = {}
        for kind, names in KIND_OPTIONS.items():
            for name in names:
                kinds.setdefault(name, []).append(kind)
        return dict(HIERARCHY_OPTIONS, **{name: "a " + " or ".join(k) + " tier" for name, k in kinds.items()})

    def unused_options(self, given: Iterable[str]) -> dict[str, str]:
        """Of the options ``given`` (field names set to a non-default value), those this hierarchy cannot use.

        Returns:
            name -> the reason (who would use it), empty when every option is used (always with ``auto``).
        """
        if self.chooses_per_request:
            return {}
        used = {name for tier in self.tier_specs for name in tier.options}
        if self.chain:
            used.add("adaptive_gamma")
        if self.tiers is None:
            used.update(gamma for _, gamma in PRESETS.get(self.mode, ()))
        users = self.option_users()
        return {name: users[name] for name in given if name in users and name not in used}

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        """The field names (the options of :class:`SpeculationConfig`)."""
        return tuple(f.name for f in fields(cls))

