"""Exact distribution under sampling across prefix reuse (``Engine(reuse_prefix=True)``) after a request that ended
in the middle of a verified block, as a stop string ends it (the text API closes the engine's generator there).

Same setting as tests/test_distribution.py (distribution.py): a 5-token vocabulary, a 20-token prompt, a retrieval
budget of 8 (tier 1 sees a different cache than the verifier), 3 generated tokens whose exact distribution (125
sequences) is enumerated with transformers. Each test draws N sequences with fixed seeds and requires a chi-square
goodness-of-fit p-value > 1e-3 (cells with expected count < 5 pooled): under the null hypothesis a given seed fails with
probability 1e-3; the seeds are fixed, so the outcome is reproducible. N = 1,000 request pairs here; the ``slow``
variants draw 10,000.
"""

import pytest
import torch

from distribution import NEW, SETTINGS, V, chi2_pvalue, exact_distribution
from triforce.engine import Engine, SpeculationConfig
from triforce.speculation.rule import rejection_sample

N_SLOW = 20000


def _spec(**kw):
    return SpeculationConfig(budget=8, chunk_size=2, gamma1=2, gamma2=2, draft_sink=2, draft_window=4, **kw)


def _reuse_after_stop(distribution_models, mode, stop_after, n, seed):
    """Request 1 samples and is closed after ``stop_after`` tokens; request 2 continues the same text (its prompt is
    the prompt plus those tokens, so the engine reuses the KV cache it kept) for the remaining tokens. Together they
    must follow the exact distribution of 3 tokens after the prompt."""
    hf, target, draft, prompt = distribution_models
    params = SETTINGS["T1"]
    spec = _spec(mode=mode)
    engine = Engine(target, draft)  # reuse_prefix=True
    blocks = []  # tokens each target verification emitted (the stats count only what the user got)

    def recording(*args, **kwargs):
        n_acc, nxt = rejection_sample(*args, **kwargs)
        blocks.append(int(n_acc[0]) + 1)
        return n_acc, nxt

    engine.tier_verify["target"] = recording
    counts = torch.zeros(V**NEW, dtype=torch.float64)
    mid_block = 0
    for i in range(n):
        blocks.clear()
        gen = engine.stream(prompt, max_new_tokens=NEW, sampling=params, spec=spec, seed=seed * 1_000_003 + i)
        first = [next(gen) for _ in range(stop_after)]
        gen.close()  # what TriForce.stream does at a stop string
        mid_block += sum(blocks) > stop_after  # the request ended inside a verified block
        rest, stats = engine.generate(prompt + first, max_new_tokens=NEW - stop_after, sampling=params, spec=spec,
                                      seed=seed * 1_000_003 + n + i)
        assert stats.tiers["target"]["reused_prefix_tokens"] == len(prompt) + stop_after - 1
        seq = first + rest
        counts[seq[0] * V * V + seq[1] * V + seq[2]] += 1
    assert mid_block > n // 10  # many requests really ended inside a block
    assert chi2_pvalue(counts, exact_distribution(hf, prompt, params)) > 1e-3


@pytest.mark.parametrize("mode,stop_after", [("triforce", 1), ("retrieval", 2)])
def test_prefix_reuse_after_a_request_ended_mid_block_keeps_the_distribution(distribution_models, mode, stop_after):
    _reuse_after_stop(distribution_models, mode, stop_after, 1000, seed=500 + stop_after)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["retrieval", "draft", "triforce"])
@pytest.mark.parametrize("stop_after", [1, 2])
def test_prefix_reuse_after_a_request_ended_mid_block_keeps_the_distribution_20k(distribution_models, mode, stop_after):
    _reuse_after_stop(distribution_models, mode, stop_after, N_SLOW // 2, seed=600 + stop_after)
