"""``mode='auto'``: the plan it chooses, the governor that bypasses drafters that do not pay, and exactness.

Bypassing and resuming the drafters must leave every cache holding exactly the accepted prefix: greedy output
equals autoregressive decoding token for token, and sampled sequences follow the exact distribution
(chi-square, p > 1e-3 with a fixed seed; under the null hypothesis a seed fails with probability 1e-3).
"""

import pytest
import torch

from distribution import N_FEATURE, SETTINGS, chi2_pvalue, empirical, exact_distribution
from tiny import hf_model, ours, pair
from triforce.engine import Engine, SpeculationConfig
from triforce.formats.loading import load_model  # noqa: F401  (import check: no cycle through auto)
from triforce.kv.caches import kv_bytes
from triforce.speculation.auto import (
    RETRIEVAL_BUDGET_BOUNDS,
    RETRIEVAL_GAMMA2_SAMPLING,
    RETRIEVAL_MIN_KV_SHARE,
    RETRIEVAL_MIN_KV_SHARE_SAMPLING,
    WEIGHT_BOUND_LAYER_BYTES,
    SpeedGovernor,
    choose_hierarchy,
)
from triforce.speculation.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0)


class ScriptedGovernor(SpeedGovernor):
    """Bypass pattern fixed by step count (not timing): draft for 3 steps, bypass for 2 tokens, and so on."""

    def __init__(self, top, on=3, off=2):
        super().__init__(top, probe=1)
        self.on, self.off, self.steps = on, off, 0

    def after_step(self, seconds, tokens):
        if self.top.drafting:
            self.counts["speculative_tokens"] += tokens
            self.steps += 1
            if self.steps % self.on == 0:
                self.top.drafting, self._left = False, self.off
                self.counts["bypasses"] += 1
        else:
            self._left -= tokens
            self.counts["autoregressive_tokens"] += tokens


def test_plan_adds_retrieval_only_when_the_kv_cache_outweighs_a_share_of_the_weights():
    model = ours(hf_model(seed=0))
    cfg, w = model.cfg, model.weight_bytes()
    per_token = kv_bytes(cfg, 1, torch.float32)
    long_p = int(RETRIEVAL_MIN_KV_SHARE * w / per_token) + 600
    short_p = int(0.5 * RETRIEVAL_MIN_KV_SHARE * w / per_token)
    short = choose_hierarchy(cfg, w, torch.float32, short_p, None, GREEDY)
    assert short.tiers == "ngram:6" and "no retrieval tier" in short.reason
    assert choose_hierarchy(cfg, w, torch.float32, long_p, None, GREEDY).tiers == "ngram:4,retrieval:6"
    # under sampling without a named drafter: plain decoding when short, the retrieval tier alone when the KV cache
    # reaches the (higher) sampling threshold
    assert choose_hierarchy(cfg, w, torch.float32, short_p, None, SamplingParams(0.6)).tiers == ""
    kv_long = kv_bytes(cfg, long_p, torch.float32)
    w_between = int(kv_long / (0.5 * (RETRIEVAL_MIN_KV_SHARE + RETRIEVAL_MIN_KV_SHARE_SAMPLING)))
    between = choose_hierarchy(cfg, w_between, torch.float32, long_p, None, SamplingParams(0.6))
    assert between.tiers == "" and "under sampling" in between.reason
    assert choose_hierarchy(cfg, w_between, torch.float32, long_p, None, GREEDY).tiers == "ngram:4,retrieval:6"
    w_small = int(kv_long / (1.5 * RETRIEVAL_MIN_KV_SHARE_SAMPLING))
    # sampled, the tier alone verifies at most RETRIEVAL_GAMMA2_SAMPLING proposals on a CPU (a smaller gamma2 stays;
    # greedy, on another device, or under a named drafter, gamma2 as asked)
    sampled = choose_hierarchy(cfg, w_small, torch.float32, long_p, None, SamplingParams(0.6))
    assert sampled.tiers == f"retrieval:{RETRIEVAL_GAMMA2_SAMPLING}" == "retrieval:3" and "gamma2 3" in sampled.reason
    assert choose_hierarchy(cfg, w_small, torch.float32, long_p, None, SamplingParams(0.6), gamma2=2).tiers == \
        "retrieval:2"
    assert choose_hierarchy(cfg, w_small, torch.float32, long_p, None, SamplingParams(0.6),
                            device_type="cuda").tiers == "retrieval:6"
    assert choose_hierarchy(cfg, w_small, torch.float32, long_p, "draft", SamplingParams(0.6)).tiers == \
        "draft:4,retrieval:6"
    assert choose_hierarchy(cfg, w_small, torch.float32, long_p, None, GREEDY).tiers == "ngram:4,retrieval:6"
    for p in (short_p, long_p):  # a named self tier drafts directly for the target
        assert choose_hierarchy(cfg, w, torch.float32, p, "self", SamplingParams(0.6)).tiers == "self:4"
    long = choose_hierarchy(cfg, w, torch.float32, long_p, "draft", GREEDY, gamma1=3, gamma2=5)
    assert long.tiers == "draft:3,retrieval:5"
    assert long.budget == max(256, long_p // 4) and long.lower_weights == "int8"
    assert choose_hierarchy(cfg, w, torch.float32, long_p, "self", GREEDY, max_budget=100).budget is None  # no tier


def test_plan_adds_the_int8_tier_under_a_weight_bound_target_on_a_cpu():
    """Layers of at least WEIGHT_BOUND_LAYER_BYTES: the int8 retrieval tier at the largest budget whatever the KV
    share (on a CPU only); a named draft that reads as much as the int8 copy is left out, a smaller one stays."""
    model = ours(hf_model(seed=0))
    cfg = model.cfg
    big = WEIGHT_BOUND_LAYER_BYTES * cfg.num_hidden_layers  # exactly at the threshold
    t06 = SamplingParams(0.6)
    plan = choose_hierarchy(cfg, big, torch.float32, 100, None, t06)
    assert plan.tiers == "retrieval:6" and plan.lower_weights == "int8" and plan.budget == RETRIEVAL_BUDGET_BOUNDS[1]
    assert "per layer" in plan.reason
    assert choose_hierarchy(cfg, big, torch.float32, 100, None, GREEDY).tiers == "ngram:4,retrieval:6"
    assert choose_hierarchy(cfg, big, torch.float32, 100, None, t06, max_budget=512).budget == 512
    assert choose_hierarchy(cfg, big - cfg.num_hidden_layers, torch.float32, 100, None, t06).tiers == ""  # just below
    assert choose_hierarchy(cfg, big, torch.float32, 100, None, t06, device_type="cuda").tiers == ""
    assert choose_hierarchy(cfg, big, torch.float32, 100, "self", t06).tiers == "self:4"  # named: drafts for the target
    heavy = choose_hierarchy(cfg, big, torch.float32, 100, "draft", t06, draft_weight_bytes=big // 4)
    assert heavy.tiers == "retrieval:6" and "left out" in heavy.reason
    light = choose_hierarchy(cfg, big, torch.float32, 100, "draft", t06, draft_weight_bytes=big // 4 - 1)
    assert light.tiers == "draft:4,retrieval:6"
    assert choose_hierarchy(cfg, big, torch.bfloat16, 100, "draft", t06, draft_weight_bytes=big // 4).tiers == \
        "draft:4,retrieval:6"  # bf16 weights: the int8 copy is half of them
    # where the attention kernel reads bf16 caches, the tier's cache is bf16 unless a draft model stays below it
    for bottom, draft_bytes, kv in ((None, None, "bfloat16"), ("draft", big // 4, "bfloat16"),
                                    ("draft", big // 4 - 1, None)):
        plan = choose_hierarchy(cfg, big, torch.float32, 100, bottom, t06, draft_weight_bytes=draft_bytes,
                                lower_kv_bf16=True)
        assert plan.lower_kv_dtype == kv and ("4096-slot bf16" in plan.reason) == (kv is not None), bottom


@pytest.mark.parametrize("temperature", [0, 0.6])
def test_auto_weight_bound_plan_equals_autoregressive_greedy_and_runs_sampled(monkeypatch, temperature):
    """The weight-bound plan on a tiny model (threshold lowered): the int8 tier holding the whole prompt; greedy
    output equals autoregressive decoding token for token, and a sampled run completes with that hierarchy."""
    monkeypatch.setattr("triforce.speculation.auto.WEIGHT_BOUND_LAYER_BYTES", 1)
    target, _ = pair(seed=7, max_pos=1024)
    engine = Engine(target)
    engine.measured_steps = None  # the bytes rule (a tiny model's measured times would decide otherwise)
    prompt = torch.randint(3, 40, (60,), generator=torch.Generator().manual_seed(5)).tolist()
    sampling = SamplingParams(temperature=temperature)
    spec = SpeculationConfig(mode="auto", gamma1=2, gamma2=4, budget=128, chunk_size=4)
    out, stats = engine.generate(prompt, max_new_tokens=24, sampling=sampling, spec=spec)
    assert stats.auto["hierarchy"] == ("ngram:2,retrieval:4" if temperature == 0 else "retrieval:4")
    assert len(out) == 24
    if temperature == 0:
        ref, _ = engine.generate(prompt, max_new_tokens=24, sampling=GREEDY, spec=SpeculationConfig())
        assert out == ref


class FakeTop:
    drafter = object()
    drafting = True

    def __init__(self):
        self.resumed = 0

    def resume_drafting(self, seq):
        self.drafting = True
        self.resumed += 1


def test_governor_bypasses_slow_speculation_and_retries_with_doubling_backoff():
    top = FakeTop()
    g = SpeedGovernor(top, probe=3, warmup=0, min_steps=4, backoff_min=32, backoff_max=512)
    assert not top.drafting
    g.before_step([])
    g.after_step(0.002, 1)  # the prefill's token (no forward): not timed, not a probe step
    for _ in range(3):  # probe: decode steps of 10 ms
        g.before_step([])
        g.after_step(0.010, 1)
    g.before_step([])
    assert top.drafting and top.resumed == 1
    for _ in range(4):  # speculative steps at 12 ms per token: slower
        g.after_step(0.036, 3)
    assert not top.drafting and g.counts["bypasses"] == 1
    for _ in range(31):
        g.before_step([])
        g.after_step(0.010, 1)
    g.before_step([])
    assert not top.drafting  # 32 tokens of backoff not yet over
    g.after_step(0.010, 1)
    g.before_step([])
    assert top.drafting and top.resumed == 2
    for _ in range(4):
        g.after_step(0.040, 3)
    assert not top.drafting and g._left == 64  # doubled
    for _ in range(64):
        g.before_step([])
        g.after_step(0.010, 1)
    g.before_step([])
    for _ in range(8):  # now it pays: 5 ms per token, by more than a standard error (none: every step alike)
        g.after_step(0.015, 3)
    assert top.drafting and g._backoff == 32
    assert g.to_dict()["speculative_ms_per_token"] == pytest.approx(5.0)


def _started(probe_seconds=(0.010,), **settings):
    """A governor past its prefill token and its probe (decode steps of ``probe_seconds``), drafting."""
    top = FakeTop()
    g = SpeedGovernor(top, probe=len(probe_seconds), warmup=0, **settings)
    g.before_step([])
    g.after_step(0.002, 1)  # the prefill's token
    for seconds in probe_seconds:
        g.before_step([])
        g.after_step(seconds, 1)
    g.before_step([])
    assert top.drafting
    return g, top


def test_governor_does_not_time_the_first_step_after_a_start():
    """The first speculative step after each (re)start carries the catch-up forward: a slow one is not held against
    speculation that pays afterwards; the step after it is timed."""
    top = FakeTop()
    g = SpeedGovernor(top, probe=1, warmup=1, min_steps=3, backoff_min=32)
    g.before_step([])
    g.after_step(0.002, 1)  # the prefill's token
    g.before_step([])
    g.after_step(0.010, 1)  # probe: 10 ms per token
    g.before_step([])
    assert top.drafting
    g.after_step(0.500, 1)  # catch-up: a 50-decode-step step emitting 1 token, not timed
    assert "tokens_per_step" not in g.to_dict()  # nothing tested yet
    g.after_step(0.020, 4)  # the step after it is timed
    for _ in range(2):
        g.after_step(0.015, 3)  # break-even 1.5 tokens per step: pays
    assert top.drafting and g.counts["bypasses"] == 0 and g.counts["speculative_tokens"] == 11
    assert g.to_dict()["speculative_ms_per_token"] == pytest.approx(50 / 10)
    assert g.to_dict()["tokens_per_step"] == pytest.approx(10 / 3, abs=1e-3)
    assert g.to_dict()["break_even_tokens_per_step"] == pytest.approx(1.5)
    for _ in range(40):  # acceptance falls to 1 token per step: bypassed once the mean + 1 SE is below 1.5
        g.after_step(0.015, 1)
        if not top.drafting:
            break
    assert not top.drafting and g.counts["bypasses"] == 1
    for _ in range(32):  # the backoff, decoding at 10 ms
        g.before_step([])
        g.after_step(0.010, 1)
    g.before_step([])
    assert top.drafting and top.resumed == 2
    g.after_step(0.500, 1)  # the catch-up after the restart: not timed either
    for _ in range(3):
        g.after_step(0.015, 3)
    assert top.drafting and g.to_dict()["tokens_per_step"] == pytest.approx(3.0)
    assert g.to_dict()["speculative_ms_per_token"] == pytest.approx(5.0)


def test_governor_keeps_a_tier_through_a_slow_phase():
    """The machine slows down for a stretch (every step 1.5x slower): speculation still emits more tokens per step
    than its break-even from the quiet steps, so it is kept, though its time per token is then above the probe's
    decode step."""
    g, top = _started(min_steps=8)
    for _ in range(8):
        g.after_step(0.040, 5)  # break-even 4 tokens per step, 5 emitted: 8 ms per token
    for _ in range(10):
        g.after_step(0.060, 5)  # 12 ms per token in the slow phase, above the 10 ms decode step
    assert top.drafting and g.counts["bypasses"] == 0
    assert g.to_dict()["break_even_tokens_per_step"] == pytest.approx(4.0)


def test_governor_bypasses_when_acceptance_falls_below_break_even():
    """Steps of a fixed cost (4 decode steps) emitting 2 or 3 tokens (mean 2.5, standard error 0.19 over 8 steps):
    bypassed at the first check."""
    g, top = _started(min_steps=8)
    for i in range(7):
        g.after_step(0.040, 2 + i % 2)
    assert top.drafting
    g.after_step(0.040, 3)
    assert not top.drafting and g.counts["bypasses"] == 1


def test_governor_needs_confidence_before_a_bypass():
    """Tokens per step 7, 1, 7, 2, 7, 3, 7, 1 at a break-even of 4.5: the mean (4.375) is below, but by less than
    one standard error (1.02): kept with ``confidence=1``, bypassed with ``confidence=0`` (the mean alone)."""
    for confidence, bypassed in ((1.0, False), (0.0, True)):
        g, top = _started(min_steps=8, confidence=confidence)
        for tokens in (7, 1, 7, 2, 7, 3, 7, 1):
            g.after_step(0.045, tokens)
        assert (not top.drafting) == bypassed and g.counts["bypasses"] == int(bypassed)


def test_governor_keeps_a_tier_that_paid_through_a_stretch_of_low_acceptance():
    """24 steps at 5 tokens, then steps at 1 token, break-even 3 tokens per step: the window of 32 steps is tested
    after each step. With k > 8 of the low steps the window's mean is 5 - k / 8 and its standard error about 0.35;
    the drafters are bypassed once the mean plus one standard error falls below 3: at k = 19, not before."""
    g, top = _started(min_steps=8, window=32)
    for _ in range(24):
        g.after_step(0.030, 5)
    for k in range(1, 19):
        g.after_step(0.030, 1)
        assert top.drafting, k
    g.after_step(0.030, 1)
    assert not top.drafting and g.counts["bypasses"] == 1


def test_governor_does_not_time_the_prefill_token():
    """The first step of a request samples the prefill's logits (no forward): as a probe sample it would make the
    decode step look several times faster than it is (2 ms against 10-14 ms) and bypass speculation that pays."""
    top = FakeTop()
    g = SpeedGovernor(top, probe=3, warmup=0, min_steps=4)
    for seconds in (0.002, 0.010, 0.012, 0.014):  # the prefill's token, then 3 decode steps: median 12 ms
        g.before_step([])
        assert not top.drafting
        g.after_step(seconds, 1)
    assert g.counts["autoregressive_tokens"] == 4 and g.to_dict()["decode_ms_per_token"] == pytest.approx(12.0)
    g.before_step([])
    assert top.drafting
    for _ in range(4):
        g.after_step(0.027, 3)  # 9 ms per token; break-even 2.7 tokens per step against the quiet 10 ms
    assert top.drafting and g.counts["bypasses"] == 0
    assert g.to_dict()["break_even_tokens_per_step"] == pytest.approx(2.7)


@pytest.mark.parametrize("settings, message", [
    (dict(window=4, min_steps=8), r"window must be >= min_steps \(8\), got 4"),
    (dict(min_steps=1), "min_steps must be >= 2"), (dict(probe=0), "probe must be >= 1"),
    (dict(confidence=-1.0), "confidence must be >= 0"), (dict(confidence=float("nan")), "confidence must be >= 0"),
    (dict(backoff_min=0), "backoff_min must be >= 1"),
    (dict(backoff_min=64, backoff_max=32), "backoff_max >= backoff_min")])
def test_governor_refuses_bad_settings(settings, message):
    with pytest.raises(ValueError, match=message):
        SpeedGovernor(FakeTop(), **settings)


@pytest.mark.parametrize("drafter", ["model", "ngram", "self"])
def test_auto_with_bypasses_equals_autoregressive_greedy(drafter):
    target, draft = pair(seed=7, max_pos=1024)
    engine = Engine(target, draft if drafter == "model" else None)
    engine.governor_factory = ScriptedGovernor
    g = torch.Generator().manual_seed(3)
    base = torch.randint(3, 40, (30,), generator=g).tolist()
    for n in (12, 90, 400):  # short (no retrieval tier) and long (retrieval tier) prompts
        prompt = (base * 20)[:n]  # repetitive: the n-gram drafter finds matches
        ref, _ = engine.generate(prompt, max_new_tokens=30, sampling=GREEDY, spec=SpeculationConfig())
        spec = SpeculationConfig(mode="auto", drafter=drafter, gamma1=2, gamma2=4, draft_sink=4, draft_window=16)
        out, stats = engine.generate(prompt, max_new_tokens=30, sampling=GREEDY, spec=spec)
        assert out == ref, (drafter, n)
        assert stats.mode == "auto" and stats.auto["bypasses"] >= 1
        assert stats.auto["speculative_tokens"] + stats.auto["autoregressive_tokens"] >= len(out)


@pytest.mark.parametrize("off, builds_per_resync", [(2, 0), (12, 1)])
def test_retrieval_tier_catches_up_after_a_short_bypass_and_reselects_after_a_long_one(monkeypatch, off,
                                                                                      builds_per_resync):
    """After a bypass of at most RetrievalTier.CATCH_UP_TOKENS (8) committed tokens the retrieval tier feeds them at
    its next step; after a longer one it re-selects its chunks. Greedy output equals autoregressive either way."""
    from triforce.speculation.tiers import RetrievalTier

    assert RetrievalTier.CATCH_UP_TOKENS == 8
    calls = {"resyncs": 0, "builds": 0, "in_resync": False}
    build, resync = RetrievalTier._build, RetrievalTier.resync

    def counted_build(self, *a):
        calls["builds"] += calls["in_resync"]
        return build(self, *a)

    def counted_resync(self, seq):
        calls["resyncs"] += 1
        calls["in_resync"] = True
        try:
            return resync(self, seq)
        finally:
            calls["in_resync"] = False
    monkeypatch.setattr(RetrievalTier, "_build", counted_build)
    monkeypatch.setattr(RetrievalTier, "resync", counted_resync)
    target, _ = pair(seed=7, max_pos=1024)
    engine = Engine(target)
    engine.governor_factory = lambda top: ScriptedGovernor(top, on=2, off=off)
    engine.choose_auto = lambda n, s, sp: choose_hierarchy(target.cfg, 1, torch.float32, n, None, s, gamma1=2,
                                                           gamma2=4, chunk_size=4, max_budget=64)
    prompt = torch.randint(3, 40, (300,), generator=torch.Generator().manual_seed(8)).tolist()
    ref, _ = engine.generate(prompt, max_new_tokens=60, sampling=GREEDY, spec=SpeculationConfig())
    out, stats = engine.generate(prompt, max_new_tokens=60, sampling=GREEDY, spec=SpeculationConfig(mode="auto"))
    assert out == ref
    assert "retrieval" in stats.auto["hierarchy"] and stats.auto["bypasses"] >= 2 and calls["resyncs"] >= 2
    if builds_per_resync:  # every resume after 12 plain tokens re-selects (the first, after 1 plain token, need not)
        assert calls["resyncs"] - 1 <= calls["builds"] <= calls["resyncs"]
    else:  # after 2 plain tokens (or the start's 1) the tier feeds them: no re-selection at a resume
        assert calls["builds"] == 0


def test_auto_matches_exact_distribution_through_bypasses(distribution_models):
    """Drafting resumed and bypassed every few steps, at T=0.6 / top-p 0.9 / top-k 5: still the exact distribution."""
    hf, target, draft, prompt = distribution_models
    params = SETTINGS["T0.6-p0.9-k5"]
    engine = Engine(target, draft)
    engine.governor_factory = lambda top: ScriptedGovernor(top, on=1, off=1)
    spec = SpeculationConfig(mode="auto", tiers=None, gamma1=2, gamma2=2, budget=8, chunk_size=2, draft_sink=2,
                             draft_window=4)
    # a 20-token prompt is below the retrieval threshold: force the three-tier plan to exercise the retrieval resync
    engine.choose_auto = lambda n, s, sp: choose_hierarchy(target.cfg, 1, torch.float32, n, "draft", s, gamma1=2,
                                                           gamma2=2, chunk_size=2, max_budget=8)
    counts = empirical(engine, prompt, params, spec, N_FEATURE, seed=95)
    assert chi2_pvalue(counts, exact_distribution(hf, prompt, params)) > 1e-3


def test_plan_leaves_out_a_retrieval_tier_that_reads_too_much_next_to_a_verifier_on_block_codes():
    """SmolLM2's shape at 4K and 8K tokens: with fp32 weights both take the int8 retrieval tier. With the verifier
    reading its block codes (a fifth of the bytes), the tier on those codes would read 0.46x the verifier's step at
    4K under sampling (above the sampling bound of 0.35: plain decoding) and 0.33x at 8K (kept, with int8
    activations); greedy, with twice the budget, 0.53x at 4K (the n-gram drafter alone) and 0.42x at 8K (kept)."""
    from triforce.model.config import ModelConfig
    from triforce.speculation.auto import RETRIEVAL_MAX_STEP_BYTES_SHARE, RETRIEVAL_MAX_STEP_BYTES_SHARE_SAMPLING

    cfg = ModelConfig(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                      rms_norm_eps=1e-5, max_position_embeddings=8192, tie_word_embeddings=True)
    w, codes = 538_090_000, 111_600_000  # fp32 bytes; Q4_1 codes of the layers and the Q8_0 LM head
    t06 = SamplingParams(0.6, 0.9)
    for n in (4000, 8000):
        fp32 = choose_hierarchy(cfg, w, torch.float32, n, None, t06)
        assert fp32.tiers == "retrieval:3" and fp32.lower_weights == "int8"
    plain = choose_hierarchy(cfg, w, torch.float32, 4000, None, t06, step_weight_bytes=codes)
    assert plain.tiers == "" and f"> {RETRIEVAL_MAX_STEP_BYTES_SHARE_SAMPLING}" in plain.reason
    sampled = choose_hierarchy(cfg, w, torch.float32, 8000, None, t06, step_weight_bytes=codes)
    assert sampled.tiers == "retrieval:3" and sampled.lower_weights == "codes" and sampled.budget == 1000
    short = choose_hierarchy(cfg, w, torch.float32, 4000, None, GREEDY, step_weight_bytes=codes)
    assert short.tiers == "ngram:6" and f"> {RETRIEVAL_MAX_STEP_BYTES_SHARE}" in short.reason
    coded = choose_hierarchy(cfg, w, torch.float32, 8000, None, GREEDY, step_weight_bytes=codes)
    # the tier reads the verifier's own codes (fewer bytes than an int8 copy) with int8 activations
    assert coded.tiers == "ngram:4,retrieval:6" and coded.lower_weights == "codes" and "block codes" in coded.reason


def test_plan_gives_the_retrieval_tier_a_bf16_cache_where_the_kernel_reads_it():
    """SmolLM2's shape at 8K tokens on block codes: where the attention kernel reads bf16 caches
    (``bf16_cache_reads_fast``), the retrieval tier (alone, or under the n-gram drafter) gets a bf16 cache, half the
    bytes a step reads of it; not under a named draft model (whose cache would follow it), not where the full cache is
    bf16 already, not without the kernel, and not for plain decoding. A user's ``lower_kv_dtype`` wins; the same
    decisions as with an fp32 tier cache at 4K and 8K (the step's share of bytes falls from 0.33 to 0.28 at 8K)."""
    from triforce.kernels.cpu import status
    from triforce.model.config import ModelConfig
    from triforce.speculation.auto import bf16_cache_reads_fast

    cfg = ModelConfig(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                      rms_norm_eps=1e-5, max_position_embeddings=8192, tie_word_embeddings=True)
    w, codes = 538_090_000, 111_600_000
    t06 = SamplingParams(0.6, 0.9)
    half = choose_hierarchy(cfg, w, torch.float32, 8000, None, t06, step_weight_bytes=codes, lower_kv_bf16=True)
    assert half.tiers == "retrieval:3" and half.lower_kv_dtype == "bfloat16" and "1000-slot bf16" in half.reason
    assert "0.28 x its bytes" in half.reason
    assert choose_hierarchy(cfg, w, torch.float32, 8000, None, t06, step_weight_bytes=codes).lower_kv_dtype is None
    greedy = choose_hierarchy(cfg, w, torch.float32, 8000, None, GREEDY, step_weight_bytes=codes, lower_kv_bf16=True)
    assert greedy.tiers == "ngram:4,retrieval:6" and greedy.lower_kv_dtype == "bfloat16"
    for n, bottom, kv in ((4000, None, torch.float32), (8000, "draft", torch.float32), (8000, None, torch.bfloat16)):
        plan = choose_hierarchy(cfg, w, kv, n, bottom, t06, step_weight_bytes=codes, lower_kv_bf16=True)
        assert plan.lower_kv_dtype is None and "-slot bf16" not in plan.reason, (n, bottom, kv)
        # the bytes it was weighed on are said: at 4K the tier would read 0.42 x the verifier's, a bf16 cache included;
        # under a bf16 full cache the tier's is bf16 too
        assert ("(bf16 cache) > 0.35" in plan.reason) == (n == 4000 or kv == torch.bfloat16), plan.reason
    assert choose_hierarchy(cfg, w, torch.float32, 4000, None, t06, step_weight_bytes=codes,
                            lower_kv_bf16=True).tiers == ""
    # a dtype the user named: the step is weighed on it, and the plan names none (the user's stands)
    fp32 = choose_hierarchy(cfg, w, torch.float32, 8000, None, t06, step_weight_bytes=codes, lower_kv_bf16=True,
                            lower_kv_dtype=torch.float32)
    assert fp32.lower_kv_dtype is None and "bf16" not in fp32.reason and "0.33 x its bytes" in fp32.reason
    named = choose_hierarchy(cfg, w, torch.float32, 8000, None, t06, step_weight_bytes=codes,
                             lower_kv_dtype=torch.bfloat16)
    assert named.lower_kv_dtype is None and "0.28 x its bytes (bf16 cache)" in named.reason
    assert SpeculationConfig(mode="auto").resolve_auto(half).lower_kv_dtype == "bfloat16"
    assert SpeculationConfig(mode="auto", lower_kv_dtype="float32").resolve_auto(half).lower_kv_dtype == "float32"
    assert bf16_cache_reads_fast("cpu") == status().startswith("on") and not bf16_cache_reads_fast("cuda")


def test_auto_with_a_bf16_retrieval_cache_equals_autoregressive_greedy():
    """``auto``'s plan with a bf16 retrieval cache (forced on a tiny model, whose KV cache is too small to take the
    tier): the same tokens as plain decoding."""
    target, draft = pair(seed=11)
    engine = Engine(target)
    engine.choose_auto = lambda n, s, sp: choose_hierarchy(target.cfg, 1, torch.float32, n, None, s, gamma1=3,
                                                           gamma2=4, chunk_size=4, max_budget=24, lower_kv_bf16=True)
    g = torch.Generator().manual_seed(12)
    for _ in range(3):
        prompt = torch.randint(3, 96, (int(torch.randint(40, 70, (1,), generator=g)),), generator=g).tolist()
        ref, _ = engine.generate(prompt, max_new_tokens=24, sampling=GREEDY)
        out, stats = engine.generate(prompt, max_new_tokens=24, sampling=GREEDY, spec=SpeculationConfig(mode="auto"))
        assert out == ref
        assert stats.auto["hierarchy"] == "ngram:3,retrieval:4" and "bf16" in stats.auto["reason"]


def test_auto_plans_with_the_tier_cache_dtype_the_user_pinned():
    """``--lower-kv-dtype float32`` with ``--mode auto``: the plan's bytes and reason are the fp32 cache's (no bf16
    plan that the pinned dtype would then contradict); without it, a bf16 cache where the kernels read one."""
    from triforce.speculation.auto import bf16_cache_reads_fast

    target = ours(hf_model(seed=13))
    engine = Engine(target)
    engine.measured_steps = None  # the bytes rule (a tiny model's measured times would decide otherwise)
    t06 = SamplingParams(0.6, 0.9)
    pinned = engine.choose_auto(2000, t06, SpeculationConfig(mode="auto", lower_kv_dtype="float32"))
    assert "retrieval" in pinned.tiers and pinned.lower_kv_dtype is None and "bf16" not in pinned.reason
    free = engine.choose_auto(2000, t06, SpeculationConfig(mode="auto"))
    assert free.tiers == pinned.tiers
    assert (free.lower_kv_dtype == "bfloat16") == bf16_cache_reads_fast("cpu") == ("bf16 cache" in free.reason)


def test_auto_honours_a_pinned_budget_or_refuses_it_naming_the_smallest():
    """``--budget 5 --adaptive-gamma`` under ``auto`` used to be raised silently to chunk + 2 gamma2 + 3. A budget is
    honoured: one below chunk + gamma2 + 2 (twice gamma2 with adaptive gamma) is refused on construction, naming
    ``budget`` and that smallest value; the smallest is taken as it is (the plan's tier takes no more), and greedy
    output is plain decoding's. ``choose_hierarchy`` given a budget with no room for a block chooses no retrieval
    tier (the reason says so) rather than exceed it."""
    for kw, smallest in ((dict(adaptive_gamma=True), 8 + 2 * 6 + 2), ({}, 8 + 6 + 2)):
        with pytest.raises(ValueError, match=rf"^budget must be >= chunk_size \+ gamma \+ 2 = {smallest} .*got 5"):
            SpeculationConfig(mode="auto", budget=5, **kw)
    target = ours(hf_model(seed=14))
    engine = Engine(target)
    engine.measured_steps = None  # the bytes rule (a tiny model's measured times would decide otherwise)
    prompt = torch.randint(3, 96, (300,), generator=torch.Generator().manual_seed(15)).tolist()
    spec = SpeculationConfig(mode="auto", budget=22, adaptive_gamma=True)
    plan = engine.choose_auto(len(prompt), GREEDY, spec)
    assert "retrieval" in plan.tiers and plan.budget == 22
    ref, _ = engine.generate(prompt, max_new_tokens=12, sampling=GREEDY)
    out, stats = engine.generate(prompt, max_new_tokens=12, sampling=GREEDY, spec=spec)
    assert out == ref and stats.auto["budget"] == 22
    small = choose_hierarchy(target.cfg, 1, torch.float32, 300, None, GREEDY, max_budget=15)
    assert "retrieval" not in small.tiers and small.budget is None and "budget 15 < " in small.reason


def test_auto_reports_no_budget_without_a_retrieval_tier():
    """A plan without a retrieval tier (a short prompt: plain decoding or the n-gram drafter) has no budget: the
    stats (``--json``'s ``auto`` object) report null, not the budget a tier would have had."""
    target = ours(hf_model(seed=14))
    engine = Engine(target)
    short = list(range(3, 23))
    for sampling in (GREEDY, SamplingParams(0.6)):
        stats = engine.generate(short, max_new_tokens=4, sampling=sampling, spec=SpeculationConfig(mode="auto"))[1]
        assert "retrieval" not in stats.auto["hierarchy"] and stats.auto["budget"] is None
        assert engine.choose_auto(len(short), sampling, SpeculationConfig(mode="auto")).budget is None


def test_plan_weighs_a_retrieval_tier_on_measured_step_times_instead_of_bytes():
    """Qwen2.5-1.5B's shape at 16K and 32K tokens on its Q4_K_M codes, sampled: the bytes rule leaves the tier out
    (a retrieval step reads 0.65x / 0.49x the verifier's bytes, above 0.35), although the tier ran at 1.13x / 1.31x
    plain decoding (docs/long_documents.md). Given the step times measured in those runs, the plan takes it: the
    prediction is tokens(alpha, 3) * decode / (3 * lower + verify), stated in the reason with the times. Times
    like the bf16 SmolLM2 copy's (a step at 0.65x the verifier's, which ran at 0.91x) leave it out. The measurement
    is asked for only where the KV-share rule admits a tier, with the budget, gamma2 and dtype the tier would run."""
    from triforce.model.config import ModelConfig
    from triforce.speculation.auto import ACCEPTANCE_PRIOR_SAMPLING, RETRIEVAL_MIN_PREDICTED_SPEEDUP
    from triforce.speculation.steptimes import StepTimes, expected_tokens

    cfg = ModelConfig(model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                      num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, head_dim=128,
                      rms_norm_eps=1e-6, max_position_embeddings=32768, tie_word_embeddings=True)
    w = codes = 1_535_000_000  # the Q4_K_M file's codes, which the verifier reads (an int8 copy: 1.56 GB)
    t06 = SamplingParams(0.6, 0.9)
    asked = []

    def measured(decode, verify, lower):
        def measure(budget, gamma, weights, kv):
            asked.append((budget, gamma, weights, kv))
            return StepTimes(16000, budget, gamma + 1, ((decode, verify, lower),))
        return measure

    bytes_only = choose_hierarchy(cfg, w, torch.float32, 16000, None, t06, step_weight_bytes=codes, lower_kv_bf16=True,
                                  int8_weight_bytes=1_560_000_000)
    assert bytes_only.tiers == "" and "0.65 x its bytes" in bytes_only.reason
    for n, (decode, verify, lower) in ((16000, (0.149, 0.200, 0.084)), (32000, (0.188, 0.249, 0.084))):
        plan = choose_hierarchy(cfg, w, torch.float32, n, None, t06, step_weight_bytes=codes, lower_kv_bf16=True,
                                int8_weight_bytes=1_560_000_000, measure=measured(decode, verify, lower))
        predicted = expected_tokens(ACCEPTANCE_PRIOR_SAMPLING, 3) * decode / (3 * lower + verify)
        assert predicted >= RETRIEVAL_MIN_PREDICTED_SPEEDUP
        assert plan.tiers == "retrieval:3" and plan.lower_weights == "codes" and plan.lower_kv_dtype == "bfloat16"
        assert f"{predicted:.2f}x plain decoding predicted" in plan.reason
        assert f"decode step {1000 * decode:.1f} ms" in plan.reason
        assert asked[-1] == (plan.budget, 3, "codes", torch.bfloat16) and plan.budget == n // 8
    slow = choose_hierarchy(cfg, w, torch.float32, 16000, None, t06, step_weight_bytes=codes,
                            int8_weight_bytes=1_560_000_000, measure=measured(0.100, 0.130, 0.065))
    assert slow.tiers == "" and slow.budget is None and f"< {RETRIEVAL_MIN_PREDICTED_SPEEDUP}" in slow.reason
    asked.clear()
    for n, bottom in ((300, None), (16000, "self")):  # below the KV share; a named self tier: nothing to time
        choose_hierarchy(cfg, w, torch.float32, n, bottom, t06, step_weight_bytes=codes,
                         int8_weight_bytes=1_560_000_000, measure=measured(1, 1, 1))
    assert asked == []
    unmeasured = choose_hierarchy(cfg, w, torch.float32, 16000, None, t06, step_weight_bytes=codes,
                                  int8_weight_bytes=1_560_000_000,
                                  measure=lambda *a: None)  # no memory to measure in: the bytes rule
    assert unmeasured.tiers == bytes_only.tiers and "x its bytes" in unmeasured.reason
    with pytest.raises(ValueError, match="gamma must be 3"):
        StepTimes(1, 1, 4, ((1.0, 1.0, 1.0),)).predicted_speedup(0.5, 6)
    # a repetition timed in a slow phase (every forward 2x) predicts what the others do: paired, not pooled
    phases = StepTimes(1, 1, 4, ((0.149, 0.200, 0.084), (0.298, 0.400, 0.168), (0.149, 0.200, 0.084)))
    assert phases.predicted_speedup(0.88, 3) == pytest.approx(expected_tokens(0.88, 3) * 0.149 / (3 * 0.084 + 0.2))
    with pytest.raises(ValueError, match="samples must be"):
        StepTimes(1, 1, 4, ())


def test_engine_measures_step_times_once_per_shape_and_keeps_no_copy_it_timed_for_nothing():
    """``Engine.step_times`` times real forwards of a tiny model (positive times), keeps them for contexts within 25%
    (forks share them), leaves the target's RoPE as it was; a plan that leaves the timed tier out drops the int8 copy
    made to time it, and greedy ``auto`` with measured times equals plain decoding token for token."""
    target = ours(hf_model(seed=16))
    engine = Engine(target)
    rope = target.rope
    first = engine.step_times(400, 64, 3, "int8", torch.float32, chunk_size=4)
    assert first.context == 400 and first.budget == 64 and first.block == 4
    assert min(first.decode, first.verify, first.lower) > 0 and target.rope is rope
    assert engine.fork().step_times(450, 64, 3, "int8", torch.float32, chunk_size=4) is first  # kept, shared
    assert engine.step_times(600, 64, 3, "int8", torch.float32, chunk_size=4) is not first  # another shape
    assert engine.lower_copies == ["int8"]
    engine = Engine(target)

    def slow(*args, **kwargs):  # makes the copy as the measurement does; predicted far below 1
        engine.lower_model(target, "int8")
        return first.__class__(400, 64, 4, ((1.0, 10.0, 1.0),))
    engine.step_times = slow
    plan = engine.choose_auto(2000, SamplingParams(0.6), SpeculationConfig(mode="auto"))
    assert plan.tiers == "" and "predicted" in plan.reason and engine.lower_copies == []
    engine = Engine(target)
    prompt = torch.randint(3, 96, (300,), generator=torch.Generator().manual_seed(17)).tolist()
    ref, _ = engine.generate(prompt, max_new_tokens=16, sampling=GREEDY)
    out, stats = engine.generate(prompt, max_new_tokens=16, sampling=GREEDY, spec=SpeculationConfig(mode="auto"))
    assert out == ref and engine.measured_steps and "measured at 300 tokens" in stats.auto["reason"]


def test_a_batched_generation_does_not_stall_the_others_to_measure_step_times():
    """Inside a batch with other generations running, ``Engine.step_times`` returns None (``auto`` plans on bytes)
    and keeps nothing, so a later request alone measures; a generation alone in the scheduler measures."""
    from triforce.model.batching import BatchScheduler

    engine = Engine(ours(hf_model(seed=16)))
    seen = {}

    def ask(name):
        return lambda: seen.setdefault(name, engine.step_times(400, 64, 3, "int8", torch.float32, chunk_size=4))

    other = engine.fork()  # a generation already waiting on its forward when the next one asks
    BatchScheduler(2).run([lambda: other.generate(list(range(3, 40)), max_new_tokens=2, sampling=GREEDY), ask("a")])
    assert seen == {"a": None} and engine.measured_steps == {}
    BatchScheduler(2).run([ask("alone")])
    assert seen["alone"] is not None and len(engine.measured_steps) == 1


def test_step_times_are_measured_in_the_kept_cache_without_changing_it():
    """With a kept prefix (a prompt cache, a previous turn), the measurement times its forwards in that cache instead
    of allocating a second one of the context's size: the kept positions, its length and its flags come back as they
    were, and the request after it gives autoregressive decoding's tokens."""
    from triforce.kv.caches import FullKVCache
    from triforce.speculation.steptimes import measure_step_times

    target = ours(hf_model(seed=18))
    cache = FullKVCache(target.cfg, 420, torch.float32, record_queries=True)
    cache.k.normal_(generator=torch.Generator().manual_seed(1))
    cache.v.normal_(generator=torch.Generator().manual_seed(2))
    cache.length = 300
    k, v = cache.k[:, :, :, :300].clone(), cache.v[:, :, :, :300].clone()
    times = measure_step_times(target, target, 400, 64, 3, 4, torch.float32, torch.float32, reps=1, reuse=cache)
    assert min(times.decode, times.verify, times.lower) > 0
    assert cache.length == 300 and cache.record_queries
    assert torch.equal(cache.k[:, :, :, :300], k) and torch.equal(cache.v[:, :, :, :300], v)
    assert not torch.equal(cache.k[:, :, :, 400:404], torch.zeros_like(cache.k[:, :, :, 400:404]))  # timed in it
    engine = Engine(target)
    prompt = torch.randint(3, 96, (300,), generator=torch.Generator().manual_seed(19)).tolist()
    ref, _ = engine.generate(prompt, max_new_tokens=12, sampling=GREEDY)
    engine.generate(prompt[:250], max_new_tokens=2, sampling=GREEDY)  # a kept prefix of 251 tokens
    out, stats = engine.generate(prompt, max_new_tokens=12, sampling=GREEDY, spec=SpeculationConfig(mode="auto"))
    assert out == ref and "measured at 300 tokens" in stats.auto["reason"]
