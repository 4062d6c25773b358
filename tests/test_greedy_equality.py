"""Greedy decoding: every mode gives exactly the autoregressive tokens; autoregressive equals transformers."""

import itertools

import pytest
import torch

from tiny import hf_model, ours, pair, random_prompts
from triforce.engine import Engine, SpeculationConfig
from triforce.speculation.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0)
# (budget, chunk_size, gamma1, gamma2): budget < prompt (retrieval differs from full), prompt lengths that are not a
# multiple of the chunk size, gamma 1, and a budget >= every prompt (retrieval cache = whole cache)
SETTINGS = [(16, 4, 2, 3), (24, 8, 4, 6), (40, 5, 1, 1), (1024, 8, 3, 4)]
MODES = ["retrieval", "draft", "triforce"]


def _check_modes(engine, prompts, settings_for, new_tokens):
    mismatches, accepted = [], 0
    for i, prompt in enumerate(prompts):
        ref, _ = engine.generate(prompt, max_new_tokens=new_tokens, sampling=GREEDY, spec=SpeculationConfig())
        for mode, (budget, chunk, g1, g2) in itertools.product(MODES, settings_for(i)):
            spec = SpeculationConfig(mode=mode, budget=budget, chunk_size=chunk, gamma1=g1, gamma2=g2,
                                     draft_sink=4, draft_window=12)
            out, stats = engine.generate(prompt, max_new_tokens=new_tokens, sampling=GREEDY, spec=spec)
            accepted += stats.tiers["target"]["accepted"]
            if out != ref:
                mismatches.append((i, mode, budget, chunk, g1, g2))
    assert not mismatches
    assert accepted > 0  # speculation really happened


def test_every_mode_equals_autoregressive_greedy(tiny_engine):
    """60 prompts (2-89 tokens) x 3 speculative modes; the (budget, chunk, gamma) settings cycle over the prompts."""
    _check_modes(tiny_engine, random_prompts(60), lambda i: [SETTINGS[i % len(SETTINGS)]], new_tokens=20)


@pytest.mark.slow
def test_every_mode_every_setting_equals_autoregressive_greedy(tiny_engine):
    """The full product: 100 prompts x 3 modes x every setting, 32 new tokens."""
    _check_modes(tiny_engine, random_prompts(100, seed=1), lambda i: SETTINGS, new_tokens=32)


def test_eos_inside_a_block_ends_generation_there():
    """Make the 5th greedy token the EOS: every mode stops right after it, with no bonus token past it."""
    target, draft = pair(seed=2)
    prompt = list(range(10, 40))
    ref, _ = Engine(target).generate(prompt, max_new_tokens=12, sampling=GREEDY, spec=SpeculationConfig())
    eos = ref[4]
    first = ref.index(eos)
    for mode in ["autoregressive"] + MODES:
        for g2 in (3, 6, 8):
            engine = Engine(target, draft, eos_ids=(eos,))
            spec = SpeculationConfig(mode=mode, budget=16, chunk_size=4, gamma1=2, gamma2=g2, draft_sink=2,
                                     draft_window=6)
            out, stats = engine.generate(prompt, max_new_tokens=12, sampling=GREEDY, spec=spec)
            assert out == ref[:first + 1], (mode, g2)
            assert stats.finish_reason == "eos"
            top = stats.tiers["target"]
            if mode != "autoregressive":
                assert top["accepted"] <= top["proposed"]
                assert top["accepted"] <= len(out)  # acceptance never counted past the EOS


@pytest.mark.parametrize("max_new", [1, 2, 5, 7])
def test_max_new_tokens_truncates_the_block(tiny_engine, max_new):
    prompt = random_prompts(1, seed=3)[0]
    ref, _ = tiny_engine.generate(prompt, max_new_tokens=max_new, sampling=GREEDY, spec=SpeculationConfig())
    assert len(ref) == max_new
    for mode in MODES:
        spec = SpeculationConfig(mode=mode, budget=16, chunk_size=4, gamma1=3, gamma2=6, draft_sink=2, draft_window=6)
        out, stats = tiny_engine.generate(prompt, max_new_tokens=max_new, sampling=GREEDY, spec=spec)
        assert out == ref and stats.finish_reason == "length"


def test_rebuild_every_keeps_greedy_equality_and_counts_rebuilds(tiny_engine):
    prompt = random_prompts(1, seed=4)[0] * 2
    ref, _ = tiny_engine.generate(prompt, max_new_tokens=40, sampling=GREEDY, spec=SpeculationConfig())
    spec = SpeculationConfig(mode="triforce", budget=20, chunk_size=4, gamma1=2, gamma2=3, rebuild_every=5,
                             draft_sink=2, draft_window=6)
    out, stats = tiny_engine.generate(prompt, max_new_tokens=40, sampling=GREEDY, spec=spec)
    assert out == ref
    assert stats.tiers["retrieval"]["rebuilds"] >= 40 // 5  # one after prefill + every 5 tokens


@pytest.mark.parametrize("score", ["max", "bound"])
def test_chunk_scores_and_acceptance_rebuilds_keep_greedy_equality(tiny_engine, score):
    rebuilds = 0
    for prompt in random_prompts(6, seed=8):
        ref, _ = tiny_engine.generate(prompt, max_new_tokens=30, sampling=GREEDY, spec=SpeculationConfig())
        spec = SpeculationConfig(mode="triforce", budget=16, chunk_size=4, gamma1=2, gamma2=4, chunk_score=score,
                                 rebuild_below=0.9, draft_sink=2, draft_window=6)
        out, stats = tiny_engine.generate(prompt, max_new_tokens=30, sampling=GREEDY, spec=spec)
        assert out == ref
        rebuilds += stats.tiers["retrieval"].get("acceptance_rebuilds", 0)
    assert rebuilds > 0  # the acceptance-triggered refresh really ran


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_autoregressive_greedy_equals_transformers_generate(family):
    hf = hf_model(seed=9, family=family, layers=2)
    model = ours(hf)
    engine = Engine(model)
    for prompt in random_prompts(4, seed=5):
        ids = torch.tensor([prompt])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        out, _ = engine.generate(prompt, max_new_tokens=20, sampling=GREEDY, spec=SpeculationConfig())
        assert out == ref


def test_prefix_reuse_gives_the_same_tokens_as_cold(tiny_engine):
    prompt = random_prompts(1, seed=6)[0]
    cold = Engine(tiny_engine.target, tiny_engine.draft, reuse_prefix=False)
    for mode in ["autoregressive"] + MODES:
        spec = SpeculationConfig(mode=mode, budget=16, chunk_size=4, gamma1=2, gamma2=3, draft_sink=2, draft_window=6)
        first, _ = tiny_engine.generate(prompt, max_new_tokens=10, sampling=GREEDY, spec=spec)
        second_prompt = prompt + first + [5, 6, 7]  # a second turn over the same document
        warm, stats = tiny_engine.generate(second_prompt, max_new_tokens=10, sampling=GREEDY, spec=spec)
        ref, _ = cold.generate(second_prompt, max_new_tokens=10, sampling=GREEDY, spec=spec)
        assert warm == ref
        assert stats.tiers["target"]["reused_prefix_tokens"] >= len(prompt) + len(first) - 1


def test_seeded_sampling_is_reproducible(tiny_engine):
    prompt = random_prompts(1, seed=7)[0]
    sampling = SamplingParams(temperature=0.8, top_p=0.9)
    for mode in ["autoregressive"] + MODES:
        spec = SpeculationConfig(mode=mode, budget=16, chunk_size=4, gamma1=2, gamma2=3, draft_sink=2, draft_window=6)
        a, sa = tiny_engine.generate(prompt, max_new_tokens=20, sampling=sampling, spec=spec, seed=123)
        b, _ = tiny_engine.generate(prompt, max_new_tokens=20, sampling=sampling, spec=spec, seed=123)
        c, _ = tiny_engine.generate(prompt, max_new_tokens=20, sampling=sampling, spec=spec, seed=124)
        assert a == b and sa.seed == 123
        assert a != c


def test_smallest_budget_rebuilds_after_the_first_verification(tiny_engine):
    """At budget = chunk_size + gamma2 + 2 the cache is re-selected after every verification, the first included
    (regression: that re-selection needed the last prompt token's query, which the first verification had not
    computed; tests/test_retrieval_tier.py has the direct cases)."""
    g = torch.Generator().manual_seed(31)
    for chunk, g2 in ((8, 6), (4, 3)):
        with pytest.raises(ValueError, match=f"budget must be >= chunk_size \\+ gamma \\+ 2 = {chunk + g2 + 2}"):
            SpeculationConfig(mode="retrieval", budget=chunk + g2 + 1, chunk_size=chunk, gamma2=g2)
        spec = SpeculationConfig(mode="retrieval", budget=chunk + g2 + 2, chunk_size=chunk, gamma2=g2)
        for _ in range(4):
            prompt = torch.randint(3, 96, (int(torch.randint(100, 300, (1,), generator=g)),), generator=g).tolist()
            ref, _ = tiny_engine.generate(prompt, max_new_tokens=20, sampling=GREEDY)
            out, stats = tiny_engine.generate(prompt, max_new_tokens=20, sampling=GREEDY, spec=spec)
            assert out == ref and stats.tiers["retrieval"]["rebuilds"] > 1


def test_packed_weights_keep_every_mode_equal_to_autoregressive():
    target, draft = pair(seed=8)
    if not (target.pack_weights() and draft.pack_weights()):
        pytest.skip("oneDNN linear kernels unavailable in this torch build")
    engine = Engine(target, draft)
    for prompt in random_prompts(6, seed=8):
        ref, _ = engine.generate(prompt, max_new_tokens=20, sampling=GREEDY)
        for mode in MODES:
            spec = SpeculationConfig(mode=mode, budget=24, chunk_size=4, gamma1=3, gamma2=5, draft_sink=2,
                                     draft_window=8)
            assert engine.generate(prompt, max_new_tokens=20, sampling=GREEDY, spec=spec)[0] == ref, mode
