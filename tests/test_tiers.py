"""The n-gram drafter and hierarchies of any depth (``--tiers``)."""

import pytest
import torch

from tiny import pair
from triforce.engine import Engine, SpeculationConfig
from triforce.speculation.ngram import NGramDrafter
from triforce.speculation.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0)


def test_ngram_proposes_what_followed_the_latest_longest_match():
    d = NGramDrafter(vocab_size=20, n=3)
    seq = [1, 2, 3, 9, 1, 2, 4, 7, 8, 5, 1, 2]  # suffix [1, 2]: latest earlier match is followed by 4, 7, 8
    d.prefill(seq)
    tokens, probs = d.propose(seq, 3)
    assert tokens == [4, 7, 8]
    assert torch.equal(probs, torch.nn.functional.one_hot(torch.tensor([4, 7, 8]), 20).float())
    seq2 = seq[:-1] + [3]  # suffix [.., 5, 1, 3]: no trigram/bigram match, unigram [3] -> followed by 9
    d.prefill(seq2)
    assert d.propose(seq2, 2)[0] == [9, 1]
    d.prefill([1, 2, 3])
    assert d.propose([1, 2, 3], 4)[0] == []  # nothing to copy


def test_ngram_min_match_length_skips_short_matches():
    seq = [1, 2, 3, 9, 1, 2, 4, 7, 8, 5, 1, 3]  # only a unigram match ([3] -> 9) for the suffix
    d = NGramDrafter(vocab_size=20, n=3, min_n=2)
    d.prefill(seq)
    assert d.propose(seq, 2)[0] == []  # the unigram match is below min_n
    seq2 = seq[:-1] + [2]  # suffix [1, 2]: bigram match followed by 4, 7
    d.prefill(seq2)
    assert d.propose(seq2, 2)[0] == [4, 7]
    for bad in (0, 4):
        with pytest.raises(ValueError, match="ngram_min"):
            NGramDrafter(vocab_size=20, n=3, min_n=bad)
    with pytest.raises(ValueError, match="ngram_min"):
        SpeculationConfig(ngram_min=0)
    assert SpeculationConfig(ngram_n=2).ngram_min == 3  # the default is capped at ngram_n where it is used


def test_ngram_stops_after_eos_and_indexes_committed_tokens():
    d = NGramDrafter(vocab_size=10, n=2, eos_ids=(0,))
    d.prefill([5, 6, 0, 7, 5])
    assert d.propose([5, 6, 0, 7, 5], 5)[0] == [6, 0]
    seq = [5, 6, 0, 7, 5, 8, 9]
    d.commit(seq)
    assert d.propose(seq + [5], 2)[0] == [8, 9]  # the newly committed occurrence of [5] is the latest


def test_bad_tiers_are_named():
    for bad in ["ngram", "ngram:0", "foo:3", "draft:2,ngram:3", "retrieval:2,retrieval:3"]:
        with pytest.raises(ValueError, match="tiers"):
            _ = SpeculationConfig(tiers=bad).chain


def _prompts(n, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        base = torch.randint(3, 96, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
        out.append((base * 8)[: int(torch.randint(8, 80, (1,), generator=g))])  # repetitive: the n-gram finds matches
    return out


@pytest.mark.parametrize("tiers", [
    "ngram:4",                       # depth 2
    "ngram:3,retrieval:5",           # depth 3
    "draft:3,retrieval:4",           # depth 3 (the TriForce preset)
    "ngram:6,draft:3,retrieval:5",   # depth 4
    "ngram:2,draft:1,retrieval:1",   # depth 4, gamma 1
])
def test_any_depth_equals_autoregressive_greedy(tiers):
    target, draft = pair(seed=0)
    engine = Engine(target, draft)
    proposed = 0
    for prompt in _prompts(12, seed=len(tiers)):
        ref, _ = engine.generate(prompt, max_new_tokens=24, sampling=GREEDY, spec=SpeculationConfig())
        spec = SpeculationConfig(tiers=tiers, budget=24, chunk_size=4, draft_sink=2, draft_window=8)
        out, stats = engine.generate(prompt, max_new_tokens=24, sampling=GREEDY, spec=spec)
        assert out == ref
        proposed += stats.tiers["target"].get("proposed", 0)
    assert proposed > 0


@pytest.mark.parametrize("tiers", ["draft:3,retrieval:4", "ngram:4,draft:2,retrieval:3"])
def test_adaptive_speculation_keeps_greedy_equality(tiers):
    """Confidence-stopped proposals and adaptive gamma change only how much is proposed, never the output."""
    target, draft = pair(seed=0)
    engine = Engine(target, draft)
    shrunk = False
    for prompt in _prompts(8, seed=11):
        ref, _ = engine.generate(prompt, max_new_tokens=30, sampling=GREEDY, spec=SpeculationConfig())
        spec = SpeculationConfig(tiers=tiers, budget=32, chunk_size=4, draft_sink=2, draft_window=8,
                                 stop_below=0.5, adaptive_gamma=True)
        out, stats = engine.generate(prompt, max_new_tokens=30, sampling=GREEDY, spec=spec)
        assert out == ref
        top = stats.tiers["target"]
        shrunk |= top.get("verifications", 0) > 0 and top["proposed"] < top["verifications"] * 4
    assert shrunk  # the adaptive rules did shorten some blocks
