"""Exact distribution under sampling while the retrieval tier re-selects its chunks during generation
(``rebuild_every``, ``rebuild_below``), with each chunk score (``mean``, ``max``, ``bound``).

Same setting as tests/test_distribution.py (distribution.py): a 5-token vocabulary, a 20-token prompt, a retrieval
budget of 8 (tier 1 sees a different cache than the verifier), 3 generated tokens whose exact distribution (125
sequences) is enumerated with transformers. Each test draws N sequences with fixed seeds and requires a chi-square
goodness-of-fit p-value > 1e-3 (cells with expected count < 5 pooled): under the null hypothesis a given seed fails with
probability 1e-3; the seeds are fixed, so the outcome is reproducible. N = 1,500 here, which is enough to reject the
TriForce reference's biased middle tier in these rebuild settings (p = 5e-7 and 8e-18 measured;
``test_biased_middle_tier_fails_with_rebuilds``); the ``slow`` variants draw 20,000.
"""

import pytest

from distribution import SETTINGS, chi2_pvalue, empirical, exact_distribution, middle_tier_resamples_from_p
from triforce.engine import Engine, SpeculationConfig
from triforce.speculation.tiers import RetrievalTier

N_FAST, N_SLOW = 1500, 20000

# rebuild_below: with a window of 1 proposed token (patched; 16 in production, more than 3 new tokens can fill), any
# rejected proposal of the retrieval tier triggers a re-selection at the next commit
REBUILDS = {
    "every1-mean-retrieval": dict(mode="retrieval", chunk_score="mean", rebuild_every=1),
    "every1-max-triforce": dict(mode="triforce", chunk_score="max", rebuild_every=1),
    "below-bound-triforce": dict(mode="triforce", chunk_score="bound", rebuild_below=0.99),
    "below-max-retrieval": dict(mode="retrieval", chunk_score="max", rebuild_below=0.99),
}


def _spec(**kw):
    return SpeculationConfig(budget=8, chunk_size=2, gamma1=2, gamma2=2, draft_sink=2, draft_window=4, **kw)


def _counting_rebuilds(engine):
    """Wrap engine.generate to add up the retrieval tier's re-selections (the first selection not counted)."""
    total = {"rebuilds": 0}
    generate = engine.generate

    def counted(*args, **kw):
        out, stats = generate(*args, **kw)
        total["rebuilds"] += stats.tiers["retrieval"]["rebuilds"] - 1
        return out, stats

    engine.generate = counted
    return total


def _check_rebuilds(distribution_models, monkeypatch, name, setting, n, seed, engine=None):
    """p-value of N sequences drawn with the rebuild setting ``name`` (and how many re-selections occurred)."""
    hf, target, draft, prompt = distribution_models
    monkeypatch.setattr(RetrievalTier, "ACCEPTANCE_WINDOW", 1)
    params = SETTINGS[setting]
    engine = engine or Engine(target, draft)
    total = _counting_rebuilds(engine)
    counts = empirical(engine, prompt, params, _spec(**REBUILDS[name]), n, seed=seed)
    assert total["rebuilds"] > n // 4  # re-selection really happened during generation
    return chi2_pvalue(counts, exact_distribution(hf, prompt, params))


@pytest.mark.parametrize("name,setting", [("every1-max-triforce", "T0.6-p0.9-k5"),  # below-bound: the slow 20k test
                                          pytest.param("below-bound-triforce", "T1", marks=pytest.mark.slow)])
def test_rebuilds_and_chunk_scores_keep_the_exact_distribution(distribution_models, monkeypatch, name, setting):
    seed = 300 + list(REBUILDS).index(name)
    assert _check_rebuilds(distribution_models, monkeypatch, name, setting, N_FAST, seed=seed) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("name", list(REBUILDS))
def test_rebuilds_and_chunk_scores_keep_the_exact_distribution_20k(distribution_models, monkeypatch, name, setting):
    seed = 400 + list(REBUILDS).index(name)
    assert _check_rebuilds(distribution_models, monkeypatch, name, setting, N_SLOW, seed=seed) > 1e-3


@pytest.mark.slow
def test_biased_middle_tier_fails_with_rebuilds(distribution_models, monkeypatch):
    """The power of the fast tests: the reference's Middle_Spec (resampling from p) is rejected at N = 1,500."""

    for name in ("every1-max-triforce", "below-bound-triforce"):
        engine = Engine(distribution_models[1], distribution_models[2])
        engine.tier_verify["retrieval"] = middle_tier_resamples_from_p
        assert _check_rebuilds(distribution_models, monkeypatch, name, "T1", N_FAST, seed=9, engine=engine) < 1e-3
