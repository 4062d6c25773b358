"""``--mode auto``: choose the hierarchy for a request, and bypass it while it does not pay.

Both parts are lossless: the verifier over the full KV cache still decides every token, so the choice changes how
many tokens a verification emits, never their distribution. The thresholds' measurements are in docs/auto.md.

* :func:`choose_hierarchy` picks the tiers once per request from the bytes a step reads (Leviathan et al. 2023,
  arXiv 2211.17192, Sec. 3.4: speculation pays when drafting is cheap next to a verification; TriForce, arXiv
  2404.11912, Sec. 4: a retrieval tier pays once the KV cache outweighs the weights):

  - a retrieval tier (``budget`` slots, :func:`retrieval_budget`) goes under the target when the full KV cache is at
    least :data:`RETRIEVAL_MIN_KV_SHARE` (sampling: :data:`RETRIEVAL_MIN_KV_SHARE_SAMPLING`) of the weights' bytes,
    or, on a CPU, when each layer holds at least :data:`WEIGHT_BOUND_LAYER_BYTES` (the step is bound by the
    weights' bytes; the budget is then the largest, QuantSpec-style self-speculation, arXiv 2502.10424);
  - either way only where its step reads at most :data:`RETRIEVAL_MAX_STEP_BYTES_SHARE` (sampling:
    :data:`RETRIEVAL_MAX_STEP_BYTES_SHARE_SAMPLING`) of the verifier's step, or, given measured step times, where
    it is predicted :data:`RETRIEVAL_MIN_PREDICTED_SPEEDUP` faster (``steptimes.py``). Its weights are an int8 copy,
    or the target's own GGUF block codes times int8 activations (``codes``, llama.cpp's integer dot products) where
    the verifier reads codes; under sampling on a CPU it proposes at most :data:`RETRIEVAL_GAMMA2_SAMPLING` tokens;
  - the bottom tier is the one the user named (a draft model, ``ngram``, ``self``); without one the n-gram drafter
    under greedy decoding and nothing under sampling. A named draft model that reads as many bytes per step as the
    int8 tier under a weight-bound target is left out.

* :class:`SpeedGovernor` bypasses the drafters while the tokens each speculative step emits fall confidently short
  of the tokens it must emit to beat plain decoding, and tries again after a doubling backoff. Greedy output is
  unchanged token for token; under sampling the distribution is unchanged, but the sample drawn for a seed depends on
  the timings.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from ..defaults import DEFAULTS
from ..kernels.cpu import status as attention_kernel_status
from ..kernels.decode_step import decode_step_status
from ..kv.caches import kv_bytes
from ..model.config import ModelConfig
from .sampling import SamplingParams
from .steptimes import StepTimes

#: a retrieval tier goes into the hierarchy when the full KV cache is at least this share of the weights' bytes:
#: below it the tier's step reads nearly as much as the verifier's (docs/auto.md, "The KV share")
RETRIEVAL_MIN_KV_SHARE = 0.25
#: the same under sampling, where fewer proposals are accepted (docs/auto.md, "The KV share")
RETRIEVAL_MIN_KV_SHARE_SAMPLING = 0.3
#: retrieval budget of the auto plan: this share of the prompt, between the bounds below (paper: 4096 of 120K)
RETRIEVAL_BUDGET_SHARE = 1 / 4
#: the same under sampling: a smaller cache, since each proposal's step reads it (docs/auto.md, "The KV share")
RETRIEVAL_BUDGET_SHARE_SAMPLING = 1 / 8
RETRIEVAL_BUDGET_BOUNDS = (256, 4096)
#: ... and only where its step reads at most this share of the bytes of the verifier's decode step (weights as the
#: verifier reads them, block codes included, plus the full KV cache) under greedy decoding (docs/auto.md)
RETRIEVAL_MAX_STEP_BYTES_SHARE = 0.45
#: the same under sampling, where fewer proposals are accepted (docs/auto.md)
RETRIEVAL_MAX_STEP_BYTES_SHARE_SAMPLING = 0.35
#: under sampling, on a CPU, a retrieval tier chosen for the KV cache's share (no tier below it) proposes at most this
#: many tokens per verification: past about 4 tokens a verification's attention is bound by the CPU's arithmetic
#: (docs/auto.md)
RETRIEVAL_GAMMA2_SAMPLING = 3
#: on a CPU, the int8 retrieval tier goes under a target with at least this many weight bytes per layer whatever
#: the KV share: there the bytes it saves outweigh a step's per-layer costs (docs/auto.md)
WEIGHT_BOUND_LAYER_BYTES = 64 * 2**20
#: with measured step times (``choose_hierarchy``'s ``measure``), a retrieval tier goes in where it is predicted at
#: least this much faster than plain decoding (the governor bypasses it if it then does not pay)
RETRIEVAL_MIN_PREDICTED_SPEEDUP = 1.05
#: the acceptance rate (each proposal, independently) the prediction assumes under greedy decoding, and under
#: sampling: priors from the measured runs (docs/auto.md)
ACCEPTANCE_PRIOR = 0.92
ACCEPTANCE_PRIOR_SAMPLING = 0.88
#: SpeedGovernor: a step's cost is this quantile of its times (the lower quartile: the machine's quiet phases;
#: docs/auto.md, "The governor")
COST_QUANTILE = 0.25


def bf16_cache_reads_fast(device_type: str) -> bool:
    """Whether a bf16 cache of a tier below the verifier is read at full speed on ``device_type`` (``"cpu"``,
    ``"cuda"``): on a CPU where ``csrc/attention.c`` and the one-call decode step (``csrc/decode_step.c``, which runs
    the tier's blocks of several tokens over the cache) run (the kernel's bf16 path; docs/auto.md, "A bf16 cache for
    the tier"). Without the kernel PyTorch's SDPA reads a bf16 cache more slowly than the kernel an fp32 one, so
    :func:`choose_hierarchy` keeps the full cache's dtype there. Raises nothing (it loads the kernels if nobody has
    yet)."""
    return (device_type == "cpu" and attention_kernel_status().startswith("on")
            and decode_step_status().startswith("on"))


@dataclass(frozen=True)
class AutoPlan:
    """The hierarchy ``--mode auto`` chose for a request and why.

    Attributes:
        tiers: the hierarchy under the target, bottom first (``SpeculationConfig.tiers`` syntax), e.g.
            ``"ngram:4,retrieval:6"``; empty: plain autoregressive decoding.
        budget: retrieval cache slots when a retrieval tier is in ``tiers``, else None (reported as null).
        lower_weights: weights of the tiers below the verifier: ``int8``, or ``codes`` (the target's own block codes
            with int8 activations, where the verifier reads block codes: fewer bytes than an int8 copy).
        reason: one sentence: the figures the choice rests on.
        lower_kv_dtype: the retrieval cache's dtype (``SpeculationConfig.lower_kv_dtype``): ``bfloat16`` where our
            attention kernel reads it (half the bytes of an fp32 cache per retrieval step), else None (the full
            cache's).
    """

    tiers: str
    budget: int | None
    lower_weights: str | None
    reason: str
    lower_kv_dtype: str | None = None


def retrieval_budget(prompt_tokens: int, greedy: bool, max_budget: int = DEFAULTS["budget"]) -> int:
    """The retrieval budget :func:`choose_hierarchy` starts from, in slots: :data:`RETRIEVAL_BUDGET_SHARE` of the
    prompt (sampling: :data:`RETRIEVAL_BUDGET_SHARE_SAMPLING`), within :data:`RETRIEVAL_BUDGET_BOUNDS`, at most
    ``max_budget`` (TriForce Sec. 5's 4,096 of 120K tokens, scaled to the prompt). Raises nothing."""
    lo, hi = RETRIEVAL_BUDGET_BOUNDS
    share = RETRIEVAL_BUDGET_SHARE if greedy else RETRIEVAL_BUDGET_SHARE_SAMPLING
    return int(min(hi, max_budget, max(lo, prompt_tokens * share)))


def choose_hierarchy(cfg: ModelConfig, weight_bytes: int, kv_dtype: torch.dtype, prompt_tokens: int, bottom: str | None,
                     sampling: SamplingParams, gamma1: int = DEFAULTS["gamma1"], gamma2: int = DEFAULTS["gamma2"],
                     chunk_size: int = DEFAULTS["chunk_size"], max_budget: int = DEFAULTS["budget"],
                     device_type: str = "cpu", draft_weight_bytes: int | None = None,
                     step_weight_bytes: int | None = None, lower_kv_bf16: bool = False,
                     lower_kv_dtype: torch.dtype | None = None, adaptive_gamma: bool = False,
                     int8_weight_bytes: int | None = None,
                     measure: Callable[[int, int, str, torch.dtype], StepTimes | None] | None = None) -> AutoPlan:
    """Choose the hierarchy for a request of ``prompt_tokens`` (rules in the module docstring).

    Args:
        cfg: the target's configuration (the KV bytes per token). weight_bytes: bytes of the target's weights.
        kv_dtype: dtype of the full KV cache. prompt_tokens: the prompt's length (>= 1).
        bottom: the bottom tier the user named (``draft``, ``ngram``, ``self``); None: chosen here.
        sampling: the request's sampling (greedy or not decides the thresholds and the bottom tier).
        gamma1, gamma2: proposals per verification of the bottom and the middle tier.
        chunk_size: retrieval chunk size.
        max_budget: the most retrieval slots (``SpeculationConfig.budget``, honoured: where it is below
            ``chunk_size + gamma2 + 2``, the room a block needs, no retrieval tier is chosen).
        device_type: where the target runs (``"cpu"``, ``"cuda"``): the weight-bound rule applies on CPUs only.
        draft_weight_bytes: bytes of the named draft model's weights (``bottom == "draft"``), or None.
        step_weight_bytes: bytes of weights the verifier's decode step reads (block codes where it has them,
            ``Transformer.step_weight_bytes``); None: ``weight_bytes``. Where fewer than an int8 copy's, the tier
            reads the target's own codes.
        adaptive_gamma: gammas may grow to twice their value: the budget leaves room for the larger blocks.
        lower_kv_bf16: a bf16 retrieval cache is read at full speed (:func:`bf16_cache_reads_fast`): a retrieval
            tier with no model below it then gets a bf16 cache where the full one is fp32.
        int8_weight_bytes: bytes of an int8 copy of the target (``Transformer.int8_weight_bytes``); None:
            ``weight_bytes`` over the KV dtype's element size.
        lower_kv_dtype: the lower caches' dtype the user named, or None; a named one is what a retrieval step is
            weighed on, and the plan then chooses none.
        measure: ``measure(budget, gamma2, lower_weights, lower_kv_dtype) -> StepTimes | None``, asked where a
            retrieval tier passes the KV-share or weight-bound rule (``Engine.step_times``); the tier then goes in
            when its :meth:`~triforce.speculation.steptimes.StepTimes.predicted_speedup` at :data:`ACCEPTANCE_PRIOR`
            (sampling: :data:`ACCEPTANCE_PRIOR_SAMPLING`) is at least :data:`RETRIEVAL_MIN_PREDICTED_SPEEDUP`, in
            place of the bytes bounds. None, or None returned: the bytes bounds.

    Returns:
        :class:`AutoPlan` (its ``budget`` None without a retrieval tier).
    """
    kv = kv_bytes(cfg, prompt_tokens, kv_dtype)
    share = kv / max(1, weight_bytes)
    budget = retrieval_budget(prompt_tokens, sampling.greedy, max_budget)
    reach = 2 * gamma2 if adaptive_gamma else gamma2  # the most tokens the tier may run ahead
    room = chunk_size + reach + 2  # the smallest budget of such a tier (SpeculationConfig's check)
    fits = max_budget >= room  # the budget given leaves room for a block: never raised above it
    budget = max(budget, room)
    sizes = f"KV cache {kv / 2**20:.0f} MiB = {share:.2f} x the weights' {weight_bytes / 2**20:.0f} MiB"
    if bottom is None:
        bottom = "ngram" if sampling.greedy else None
        who = "n-gram drafter (greedy)" if bottom else "no drafter below (sampling)"
    else:
        who = f"{bottom} drafts (named)"
    threshold = RETRIEVAL_MIN_KV_SHARE if sampling.greedy else RETRIEVAL_MIN_KV_SHARE_SAMPLING
    retrieval = fits and share >= threshold and prompt_tokens > budget and bottom != "self"
    layer_bytes = weight_bytes / max(1, cfg.num_hidden_layers)
    weight_bound = (fits and not retrieval and bottom != "self" and device_type == "cpu"
                    and layer_bytes >= WEIGHT_BOUND_LAYER_BYTES)
    if weight_bound:
        budget = max(int(min(RETRIEVAL_BUDGET_BOUNDS[1], max_budget)), room)  # the whole prompt where it fits
    int8_bytes = (weight_bytes // torch.empty((), dtype=kv_dtype).element_size() if int8_weight_bytes is None
                  else int8_weight_bytes)
    verifier_bytes = weight_bytes if step_weight_bytes is None else step_weight_bytes
    # the tier reads the target's own weights where the verifier reads fewer bytes than an int8 copy (block codes)
    lower_weights, lower_bytes = ("int8", int8_bytes) if int8_bytes <= verifier_bytes else ("codes", verifier_bytes)
    lower = "int8 weights" if lower_weights == "int8" else "the target's own block codes and int8 activations"
    # a named draft model that reads at least the tier's bytes per step has no place under a weight-bound target
    left_out = (weight_bound and bottom == "draft" and draft_weight_bytes is not None
                and draft_weight_bytes >= lower_bytes)
    half_cache = (lower_kv_dtype is None and lower_kv_bf16 and kv_dtype == torch.float32
                  and (bottom in (None, "ngram") or left_out))
    lower_kv = lower_kv_dtype or (torch.bfloat16 if half_cache else kv_dtype)
    step_share = (lower_bytes + kv_bytes(cfg, budget, lower_kv)) / max(1, verifier_bytes + kv)
    max_step_share = RETRIEVAL_MAX_STEP_BYTES_SHARE if sampling.greedy else RETRIEVAL_MAX_STEP_BYTES_SHARE_SAMPLING
    if weight_bound:  # a tier reading as much as the verifier cannot pay
        max_step_share = 1.0
    steps = (f"the verifier's step reads {verifier_bytes / 2**20:.0f} MiB of weights, a retrieval step "
             f"{step_share:.2f} x its bytes{' (bf16 cache)' if lower_kv == torch.bfloat16 else ''}")
    too_heavy = (weight_bound or retrieval) and step_share > max_step_share
    bound = f"> {max_step_share}"
    shorter = retrieval and not sampling.greedy and bottom is None and device_type == "cpu"
    tier_gamma = min(gamma2, RETRIEVAL_GAMMA2_SAMPLING) if shorter else gamma2
    if (weight_bound or retrieval) and measure is not None:  # measured times decide, not bytes (steptimes.py)
        alpha = ACCEPTANCE_PRIOR if sampling.greedy else ACCEPTANCE_PRIOR_SAMPLING
        times = measure(budget, tier_gamma, lower_weights, lower_kv)
        if times is not None:
            speedup = times.predicted_speedup(alpha, tier_gamma)
            too_heavy = speedup < RETRIEVAL_MIN_PREDICTED_SPEEDUP
            steps = (f"{times.describe()}{' (bf16 cache)' if lower_kv == torch.bfloat16 else ''}: "
                     f"{speedup:.2f}x plain decoding predicted at acceptance {alpha}")
            bound = f"< {RETRIEVAL_MIN_PREDICTED_SPEEDUP}"
    if too_heavy:
        weight_bound = retrieval = False
    if weight_bound:
        why = (f"{sizes}, {layer_bytes / 2**20:.0f} MiB of weights per layer >= "
               f"{WEIGHT_BOUND_LAYER_BYTES / 2**20:.0f}: steps bound by the weights' bytes, a {budget}-slot"
               f"{' bf16' if lower_kv == torch.bfloat16 else ''} retrieval tier with {lower} ({steps})")
        if left_out:
            why += (f"; the draft model ({draft_weight_bytes / 2**20:.0f} MiB) reads more per step than the tier's "
                    f"{lower} ({lower_bytes / 2**20:.0f} MiB), so it is left out")
            bottom = None
        elif bottom:
            why += f"; {who}"
    elif retrieval:
        why = (f"{sizes} >= {threshold}: a {budget}-slot{' bf16' if lower_kv == torch.bfloat16 else ''} retrieval "
               f"tier with {lower} ({steps}); {who}")
    if retrieval and shorter and gamma2 > RETRIEVAL_GAMMA2_SAMPLING:
        gamma2 = RETRIEVAL_GAMMA2_SAMPLING
        why += (f"; gamma2 {gamma2}: on a CPU a verification of more tokens is bound by its attention's arithmetic, "
                "so shorter ones pay under sampling")
    if weight_bound or retrieval:
        tiers = f"{bottom}:{gamma1},retrieval:{gamma2}" if bottom else f"retrieval:{gamma2}"
    else:
        tiers = f"{bottom}:{gamma1 if bottom == 'self' else gamma2}" if bottom else ""
        why = (f"{sizes}; {steps} {bound}: no retrieval tier" if too_heavy
               else f"{sizes}: no retrieval tier" + ("" if bottom == "self" else
                    f" (budget {max_budget} < chunk_size + gamma2 + 2 = {room})" if not fits else
                    f" (below {threshold}{'' if sampling.greedy else ' under sampling'} or the prompt fits the "
                    "budget)"))
        why += f"; {who}"
    tier_cache = "bfloat16" if half_cache and (weight_bound or retrieval) else None
    return AutoPlan(tiers=tiers, budget=budget if weight_bound or retrieval else None, lower_weights=lower_weights,
                    reason=why, lower_kv_dtype=tier_cache)


@dataclass
class SpeedGovernor:
    """Bypasses the drafters of the top tier while their tokens per verification do not pay for the verification.

    The rule (Leviathan et al. 2023, arXiv 2211.17192, Sec. 3.4): a speculative step of ``s`` seconds that emits
    ``t`` tokens beats plain decoding when ``t > c = s / d``, ``d`` a decode step's seconds per token. ``c`` is the
    lower quartile (:data:`COST_QUANTILE`) of the window's step times over that of the decode steps' times per token:
    a machine runs in phases of slow steps, and the quiet samples of each give the ratio (docs/auto.md, "The
    governor"). The drafters are bypassed when the window's mean tokens per step is below ``c`` by
    :attr:`confidence` standard errors, so a short stretch of low acceptance is not a bypass.

    The first :attr:`probe` steps decode without drafting to time a decode step (more decode samples join while the
    drafters are bypassed). Then the drafters run; the first :attr:`warmup` speculative steps after each (re)start
    are not timed (one-off costs: the retrieval cache's first selection, the lower tiers' catch-up); from
    :attr:`min_steps` timed steps on, the last :attr:`window` are tested after each step. A bypass lasts ``backoff``
    tokens (:attr:`backoff_min`, doubling up to :attr:`backoff_max` while it keeps failing), then the drafters are
    tried again (``ModelTier.resume_drafting``); a window that pays by :attr:`confidence` standard errors resets the
    backoff. Times are wall-clock seconds of each ``step`` + ``commit``; a request's first step (its token comes from
    the prefill's logits, no forward) is neither timed nor counted towards the probe.

    Attributes:
        top: the verifier tier (:class:`~triforce.speculation.tiers.ModelTier`) whose ``drafting`` flag this sets.
        confidence: standard errors of the mean tokens per step below ``c`` before a bypass (0: the mean alone).

    Raises:
        ValueError: ``window`` < ``min_steps``, ``min_steps`` < 2 (a standard error needs two steps), ``probe`` < 1,
            ``confidence`` < 0, ``backoff_min`` < 1 or ``backoff_max`` < ``backoff_min``.
    """

    top: object
    probe: int = 3
    warmup: int = 1
    window: int = 32
    min_steps: int = 8
    confidence: float = 1.0
    backoff_min: int = 16
    backoff_max: int = 1024

    def __post_init__(self) -> None:
        if self.min_steps < 2:
            raise ValueError(f"min_steps must be >= 2 (a standard error needs two steps), got {self.min_steps}")
        if self.window < self.min_steps:
            raise ValueError(f"window must be >= min_steps ({self.min_steps}), got {self.window}")
        if self.probe < 1:
            raise ValueError(f"probe must be >= 1 (a decode step's time is needed), got {self.probe}")
        if not self.confidence >= 0:
            raise ValueError(f"confidence must be >= 0, got {self.confidence}")
        if self.backoff_min < 1 or self.backoff_max < self.backoff_min:
            raise ValueError(f"backoff_min must be >= 1 and backoff_max >= backoff_min, got {self.backoff_min} and "
                             f"{self.backoff_max}")
        self.counts = {"speculative_tokens": 0, "autoregressive_tokens": 0, "bypasses": 0}
        self._decode: deque = deque(maxlen=16)  # decode steps' seconds per token
        self._spec: deque = deque(maxlen=self.window)  # (seconds, tokens) of the timed speculative steps
        self._left = self.probe  # tokens to decode before the drafters run (again)
        self._backoff = self.backoff_min
        self._untimed = 0  # speculative steps still to skip (warm-up)
        self._first = True
        self._tested: tuple | None = None  # (mean tokens per step, c) at the last test
        self.top.drafting = False

    def before_step(self, seq: list[int]) -> None:
        """Resume drafting when a bypass has run its course (the lower tiers catch up with ``seq``)."""
        if not self.top.drafting and self._left <= 0 and self.top.drafter is not None:
            self.top.resume_drafting(seq)
            self._spec.clear()
            self._untimed = self.warmup

    def after_step(self, seconds: float, tokens: int) -> None:
        """Record a step's wall time (seconds) and emitted tokens; bypass the drafters if they do not pay."""
        if tokens <= 0:
            return
        if self._first and not self.top.drafting:  # the prefill's token: no forward in this step's time
            self._first = False
            self.counts["autoregressive_tokens"] += tokens
            return
        self._first = False
        if not self.top.drafting:
            self._decode.append(seconds / tokens)
            self._left -= tokens
            self.counts["autoregressive_tokens"] += tokens
            return
        self.counts["speculative_tokens"] += tokens
        if self._untimed > 0:  # a one-off catch-up or selection is in this step's time
            self._untimed -= 1
            return
        self._spec.append((seconds, tokens))
        if len(self._spec) < self.min_steps:
            return
        c, mean, se = self.break_even(), *_mean_se([t for _, t in self._spec])
        self._tested = (mean, c)
        if mean + self.confidence * se < c:
            self.top.drafting = False
            self._left = self._backoff
            self._backoff = min(2 * self._backoff, self.backoff_max)
            self.counts["bypasses"] += 1
        elif mean - self.confidence * se > c:
            self._backoff = self.backoff_min  # paying: a later failure starts over

    def break_even(self) -> float:
        """``c``: the tokens a speculative step must emit to beat plain decoding, the lower quartile of the window's
        step times over the lower quartile of the decode times per token (class docstring); infinite where the
        decode steps took no measurable time.

        Raises:
            ValueError: no speculative or no decode step has been timed yet.
        """
        decode = lower_quartile(self._decode)
        spec = lower_quartile([s for s, _ in self._spec])
        return spec / decode if decode > 0 else math.inf

    def to_dict(self) -> dict:
        """The counters and the last estimates for the stats: ``decode_ms_per_token`` (median of the decode steps),
        ``speculative_ms_per_token`` (the window's time per emitted token), and at the last test of the window
        (none before ``min_steps`` timed steps) ``tokens_per_step`` (its mean) and ``break_even_tokens_per_step``
        (``c``)."""
        d = dict(self.counts)
        if self._decode:
            d["decode_ms_per_token"] = round(1000 * statistics.median(self._decode), 3)
        if self._spec:
            d["speculative_ms_per_token"] = round(1000 * _per_token(self._spec), 3)
        if self._tested is not None:
            mean, c = self._tested
            d["tokens_per_step"] = round(mean, 3)
            d["break_even_tokens_per_step"] = round(c, 3) if math.isfinite(c) else None  # JSON has no infinity
        return d


def lower_quartile(xs) -> float:
    """The :data:`COST_QUANTILE` of ``xs`` (nearest rank at or below: the minimum for up to 4 samples), the cost
    :class:`SpeedGovernor` estimates a step's time with.

    Raises:
        ValueError: ``xs`` is empty.
    """
    if not xs:
        raise ValueError("lower_quartile needs at least one value, got none")
    xs = sorted(xs)
    return xs[int(COST_QUANTILE * (len(xs) - 1))]


def _mean_se(xs: list[float]) -> tuple[float, float]:
    """Mean and standard error of the mean of ``xs`` (at least 2 values)."""
    return statistics.fmean(xs), statistics.stdev(xs) / len(xs) ** 0.5


def _per_token(steps) -> float:
    """Seconds per emitted token over (seconds, tokens) steps."""
    return sum(s for s, _ in steps) / sum(t for _, t in steps)
