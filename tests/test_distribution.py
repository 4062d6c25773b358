"""End to end: each mode's generated sequences follow the exact autoregressive distribution.

A tiny target with a 5-token vocabulary, a 20-token prompt and a retrieval budget of 8 (so tier 1 really sees a
different cache than the verifier). The exact distribution of the 3 generated tokens (125 sequences) is computed
by enumeration with the transformers implementation of the target; each mode generates N sequences, and a
chi-square goodness-of-fit test (cells with expected count < 5 pooled) must give p > 1e-3 (fixed seeds; under
the null hypothesis a given seed fails with probability 1e-3). A hierarchy whose middle tier resamples from its
own distribution instead of the residual (the TriForce reference's Middle_Spec) must fail the same test.
"""

import pytest
import torch

from distribution import (
    N_FAST,
    N_FEATURE,
    N_SLOW,
    SETTINGS,
    chi2_pvalue,
    empirical,
    exact_distribution,
    middle_tier_resamples_from_p,
)
from triforce.engine import Engine, SpeculationConfig


def _spec(mode):
    return SpeculationConfig(mode=mode, budget=8, chunk_size=2, gamma1=2, gamma2=2, draft_sink=2, draft_window=4)


MODES = ["autoregressive", "retrieval", "draft", "triforce"]


# CI time: the speculative modes with the warped setting, autoregressive in both, in every run; the rest runs with
# the slow 20k test below (and pure sampling through the 4-tier hierarchy, test_depth_4_..., in every run)
_FAST = {("autoregressive", "T1"), ("autoregressive", "T0.6-p0.9-k5"), ("retrieval", "T0.6-p0.9-k5"),
         ("triforce", "T0.6-p0.9-k5")}
_FAST_CASES = [(mode, setting) if (mode, setting) in _FAST else pytest.param(mode, setting, marks=pytest.mark.slow)
               for mode in MODES for setting in SETTINGS]


@pytest.mark.parametrize("mode,setting", _FAST_CASES)
def test_mode_matches_exact_distribution(distribution_models, mode, setting):
    hf, target, draft, prompt = distribution_models
    params = SETTINGS[setting]
    exact = exact_distribution(hf, prompt, params)
    engine = Engine(target, draft)
    counts = empirical(engine, prompt, params, _spec(mode), N_FAST, seed=MODES.index(mode) + 10 * len(setting))
    assert chi2_pvalue(counts, exact) > 1e-3


def test_depth_4_hierarchy_matches_exact_distribution(distribution_models):
    """ngram -> draft -> retrieval -> full target, at T=1."""
    hf, target, draft, prompt = distribution_models
    params = SETTINGS["T1"]
    spec = SpeculationConfig(tiers="ngram:2,draft:2,retrieval:2", budget=8, chunk_size=2, draft_sink=2, draft_window=4)
    engine = Engine(target, draft)
    counts = empirical(engine, prompt, params, spec, N_FEATURE, seed=77)
    assert chi2_pvalue(counts, exact_distribution(hf, prompt, params)) > 1e-3


def test_adaptive_triforce_matches_exact_distribution(distribution_models):
    """Confidence-stopped drafts and adaptive gamma at T=0.6 / top-p 0.9 / top-k 5 stay exact."""
    hf, target, draft, prompt = distribution_models
    params = SETTINGS["T0.6-p0.9-k5"]
    spec = SpeculationConfig(mode="triforce", budget=12, chunk_size=2, gamma1=2, gamma2=2, draft_sink=2,
                             draft_window=4, stop_below=0.6, adaptive_gamma=True)
    counts = empirical(Engine(target, draft), prompt, params, spec, N_FEATURE, seed=78)
    assert chi2_pvalue(counts, exact_distribution(hf, prompt, params)) > 1e-3


def test_broken_middle_tier_fails_the_same_test(distribution_models):
    hf, target, draft, prompt = distribution_models
    params = SETTINGS["T1"]
    engine = Engine(target, draft)
    engine.tier_verify["retrieval"] = middle_tier_resamples_from_p
    counts = empirical(engine, prompt, params, _spec("triforce"), N_FAST, seed=99)
    assert chi2_pvalue(counts, exact_distribution(hf, prompt, params)) < 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("mode", MODES)
def test_mode_matches_exact_distribution_20k(distribution_models, mode, setting):
    hf, target, draft, prompt = distribution_models
    params = SETTINGS[setting]
    counts = empirical(Engine(target, draft), prompt, params, _spec(mode), N_SLOW, seed=7 + MODES.index(mode))
    assert chi2_pvalue(counts, exact_distribution(hf, prompt, params)) > 1e-3


def test_int8_lower_tiers_with_bf16_caches_match_exact_distribution(distribution_models, monkeypatch):
    """Cheaper lower tiers (int8 weights, bf16 retrieval and draft caches) under the fp32 verifier stay exact; the
    retrieval tier's steps over its bf16 cache run every layer in one call (``csrc/decode_step.c`` with the
    attention kernel's bf16 path) where those kernels are on."""
    from triforce.kernels import decode_step

    hf, target, draft, prompt = distribution_models
    steps = []
    real = decode_step.decode_layers
    monkeypatch.setattr("triforce.kernels.decode_step.decode_layers",
                        lambda *a: (r := real(*a), steps.append((a[2].dtype, r is not None)))[0])
    params = SETTINGS["T0.6-p0.9-k5"]
    spec = SpeculationConfig(mode="triforce", budget=8, chunk_size=2, gamma1=2, gamma2=2, draft_sink=2, draft_window=4,
                             lower_weights="int8", lower_kv_dtype="bfloat16")
    counts = empirical(Engine(target, draft), prompt, params, spec, N_FEATURE, seed=79)
    assert chi2_pvalue(counts, exact_distribution(hf, prompt, params)) > 1e-3
    if decode_step.decode_step_status().startswith("on"):
        assert (torch.bfloat16, True) in steps


@pytest.mark.slow  # CI time: the same driver runs the block-code verifier's test in every run (test_blockcodes.py)
def test_int8_retrieval_tier_in_one_kernel_call_matches_exact_distribution(distribution_models, monkeypatch):
    """The int8 retrieval tier with fp32 caches, whose decode steps run every layer in one call
    (``csrc/decode_step.c``), under the fp32 verifier: the exact distribution (same bound as above)."""
    from triforce.kernels import decode_step

    hf, target, draft, prompt = distribution_models
    steps = []
    real = decode_step.decode_layers
    monkeypatch.setattr("triforce.kernels.decode_step.decode_layers",
                        lambda *a: (r := real(*a), steps.append(r is not None))[0])
    params = SETTINGS["T0.6-p0.9-k5"]
    spec = SpeculationConfig(mode="retrieval", budget=8, chunk_size=2, gamma2=3, lower_weights="int8")
    counts = empirical(Engine(target, draft), prompt, params, spec, N_FAST, seed=83)
    assert chi2_pvalue(counts, exact_distribution(hf, prompt, params)) > 1e-3
    if decode_step.decode_step_status().startswith("on"):
        assert steps and all(steps)
