"""The retrieval tier (``tiers.py``, ``RetrievalTier``) at its edges: re-selecting its chunks right after the first
verification (also one that accepted nothing), the smallest budget, and a retrieval tier below another tier reaching
as far as the block above it (``SpeculationConfig.reach``); greedy output equals autoregressive decoding's."""

import pytest

from tiny import random_prompts
from triforce.engine import Engine, SpeculationConfig
from triforce.speculation.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0)
SAMPLED = SamplingParams(temperature=0.9, top_p=0.95)


def _count_unrecorded_queries(monkeypatch) -> list:
    """Record every position whose query the retrieval tier asked the full cache for while the full cache's last
    forward did not compute it (the case that used to crash); returns the list it fills."""
    from triforce.kv.caches import CacheError, FullKVCache

    missed = []
    original = FullKVCache.query_at

    def query_at(cache, position):
        try:
            return original(cache, position)
        except CacheError:
            missed.append(position)
            raise

    monkeypatch.setattr(FullKVCache, "query_at", query_at)
    return missed


# ------------------------------------------------------------------ re-selection at the first commit
@pytest.mark.parametrize("kw", [
    dict(mode="retrieval", budget=16, chunk_size=4, gamma2=3, rebuild_every=1),
    dict(mode="triforce", budget=16, chunk_size=4, gamma1=2, gamma2=3, rebuild_every=1, draft_sink=2, draft_window=6),
    dict(mode="retrieval", budget=40, chunk_size=4, gamma2=16, rebuild_below=1.0),  # 16 proposals fill the window
], ids=["rebuild-every-1", "triforce-rebuild-every-1", "rebuild-below-gamma16"])
def test_reselection_right_after_the_first_verification(tiny_engine, kw, monkeypatch):
    """Re-selecting at the first commit needs the last prompt token's query: the first verification reused the
    prefill's logits, so when it accepted nothing that query was not in its forward ("full KV cache: no recorded
    query for position P-1"). Greedy output must equal autoregressive, and the case must really occur."""
    missed = _count_unrecorded_queries(monkeypatch)
    spec = SpeculationConfig(**kw)
    for prompt in random_prompts(4, seed=41, lo=30):
        ref, _ = tiny_engine.generate(prompt, max_new_tokens=24, sampling=GREEDY)
        out, stats = tiny_engine.generate(prompt, max_new_tokens=24, sampling=GREEDY, spec=spec)
        assert out == ref
        assert stats.tiers["retrieval"]["rebuilds"] > 1
        tiny_engine.generate(prompt, max_new_tokens=24, sampling=SAMPLED, spec=spec, seed=5)  # no crash under sampling
    assert missed  # the failing case occurred (and was served by the kept query)


def test_reselection_after_a_first_verification_that_accepted_nothing(tiny_engine):
    """The exact failing case, forced: the verifier rejects the whole first block (a verification rule that accepts
    nothing and emits the target's argmax stays lossless under greedy decoding), then the chunks are re-selected."""
    from triforce.speculation.rule import rejection_sample

    def reject_all(d, q, p, generator, greedy=False):
        n_acc, nxt = rejection_sample(d[:, :0], q[:, :0], p[:, :1], generator, greedy=greedy)
        return n_acc, nxt

    spec = SpeculationConfig(mode="retrieval", budget=16, chunk_size=4, gamma2=3, rebuild_every=1)
    eng = Engine(tiny_engine.target)
    eng.tier_verify["target"] = reject_all
    for prompt in random_prompts(3, seed=42, lo=30):
        ref, _ = tiny_engine.generate(prompt, max_new_tokens=6, sampling=GREEDY)
        out, stats = eng.generate(prompt, max_new_tokens=6, sampling=GREEDY, spec=spec)
        assert out == ref
        assert stats.tiers["target"]["accepted"] == 0 and stats.tiers["retrieval"]["rebuilds"] >= 6


def test_smallest_budget_is_chunk_plus_gamma_plus_2(tiny_engine):
    with pytest.raises(ValueError, match=r"budget must be >= chunk_size \+ gamma \+ 2 = 9"):
        SpeculationConfig(mode="retrieval", budget=8, chunk_size=4, gamma2=3)
    spec = SpeculationConfig(mode="retrieval", budget=9, chunk_size=4, gamma2=3)
    for prompt in random_prompts(4, seed=43, lo=30):
        ref, _ = tiny_engine.generate(prompt, max_new_tokens=20, sampling=GREEDY)
        out, stats = tiny_engine.generate(prompt, max_new_tokens=20, sampling=GREEDY, spec=spec)
        assert out == ref and stats.tiers["retrieval"]["rebuilds"] > 1


# ------------------------------------------------------------------ a retrieval tier not directly under the target
@pytest.mark.parametrize("tiers,reach", [("retrieval:2,draft:8", 8), ("retrieval:1,draft:5", 5),
                                         ("ngram:2,retrieval:3,draft:6", 6)])
def test_retrieval_tier_below_another_tier_reaches_as_far_as_the_block_above(tiny_engine, tiers, reach):
    """Its lookahead and budget check use the largest gamma of the tiers above it, not its own: at the smallest
    budget that passes validation it never runs out of slots (it used to: "retrieval cache budget exhausted")."""
    chunk = 4
    with pytest.raises(ValueError, match=f"budget must be >= chunk_size \\+ gamma \\+ 2 = {chunk + reach + 2}"):
        SpeculationConfig(tiers=tiers, budget=chunk + reach + 1, chunk_size=chunk)
    for adaptive in (False, True):
        budget = chunk + (2 if adaptive else 1) * reach + 2
        spec = SpeculationConfig(tiers=tiers, budget=budget, chunk_size=chunk, draft_sink=2, draft_window=6,
                                 adaptive_gamma=adaptive)
        assert spec.reach(0) == (2 if adaptive else 1) * reach
        for prompt in random_prompts(2, seed=44, lo=30):
            ref, _ = tiny_engine.generate(prompt, max_new_tokens=30, sampling=GREEDY)
            out, _ = tiny_engine.generate(prompt, max_new_tokens=30, sampling=GREEDY, spec=spec)
            assert out == ref, (tiers, adaptive)
            tiny_engine.generate(prompt, max_new_tokens=30, sampling=SAMPLED, spec=spec, seed=3)  # no exhaustion either


def test_reach_is_the_largest_gamma_at_and_above_a_tier():
    spec = SpeculationConfig(tiers="ngram:9,retrieval:2,draft:5", budget=64)
    assert [spec.reach(i) for i in range(3)] == [9, 5, 5]
    with pytest.raises(IndexError, match=r"index must be in \[0, 3\)"):
        spec.reach(3)
