"""Generation statistics (``tierstats.py``, ``GenerationStats``): nothing past a stop string is counted, a block
cut at a position is discounted exactly, and the summary line's wording."""

import pytest

from triforce import SamplingParams, SpeculationConfig, TriForce
from triforce.speculation.stats import TierStats

GREEDY = SamplingParams(temperature=0)


@pytest.mark.parametrize("mode", ["retrieval", "triforce"])
def test_nothing_past_a_stop_string_is_counted(tiny_folder, mode):
    """Every target step verifies a block here, so the target's emitted tokens (accepted + recovered/bonus) must equal
    the tokens the user got; a stop string mid-block used to leave the rest of the block in the counters."""
    tf = TriForce.load(tiny_folder, "ngram")
    spec = SpeculationConfig(mode=mode, budget=256, chunk_size=4, gamma2=6, gamma1=3, drafter="ngram", ngram_min=1)
    prompt = "the quick brown fox jumps over the lazy dog " * 3
    full = tf.generate(prompt, max_new_tokens=40, sampling=GREEDY, spec=spec)
    assert full.stats.tiers["target"]["acceptance_rate"] > 0.5  # blocks of several tokens, so stops fall inside them
    cut_inside = 0
    for cut in range(1, 30):
        r = tf.generate(prompt, max_new_tokens=40, sampling=GREEDY, spec=spec, stop=[full.text[cut:cut + 2]])
        assert r.finish_reason == "stop"
        t = r.stats.tiers["target"]
        n = r.stats.generated_tokens
        assert n == len(r.token_ids)
        assert round(t["mean_tokens_per_verification"] * t["verifications"]) == n
        assert t["accepted"] <= n and t["accepted"] <= t["proposed"]
        cut_inside += n % 7 != 0
        for name, tier in r.stats.tiers.items():
            if tier.get("verifications"):
                assert 0 <= tier["accepted"] <= tier["proposed"], (name, tier)
    assert cut_inside > 10


def test_discount_past_exact_counts():
    s = TierStats("target", verifications=3, proposed=18, accepted=14, emitted=17,
                  accepted_lengths=[0, 0, 1, 0, 0, 0, 2])
    s.blocks = [(100, 6, 6, 7), (107, 6, 2, 3), (110, 6, 6, 7)]  # the last two reach past position 108
    s.discount_past(108)
    # block 2 keeps 1 position (107): proposed 6 -> 1, accepted 2 -> 1, emitted 3 -> 1; block 3 is wholly past
    assert (s.verifications, s.proposed, s.accepted, s.emitted) == (2, 6 + 1, 6 + 1, 7 + 1)
    assert s.accepted_lengths == [0, 1, 0, 0, 0, 0, 1]  # block 2 now accepted 1; block 3 is gone
    assert s.blocks == []


def test_summary_says_1_token():
    from triforce.engine import GenerationStats

    s = GenerationStats(mode="autoregressive", prompt_tokens=1, generated_tokens=1, finish_reason="length",
                        prefill_seconds=0.5, decode_seconds=0.25, decode_tokens_per_second=4.0,
                        mean_time_between_tokens_ms=250.0, peak_memory_bytes=1, seed=0)
    assert s.summary() == "autoregressive: 1 token, 4.00 tok/s, TBT 250.0 ms, prefill 0.50 s (1 token)"
    s.prompt_tokens, s.prompt_cache = 4000, {"loaded_tokens": 3991, "loaded_from": "f", "stored": None}
    assert s.summary().endswith("prefill 0.50 s (4000 tokens, 3991 loaded from the prompt cache)")
