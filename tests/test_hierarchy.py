"""The canonical hierarchy (tier specs, presets, unused options refused with the reason) and the request plan
(issue 12, items 2 and 3). Tiny models, no generation: each test well under a second."""

import pytest
import torch

from tiny import pair
from triforce.cli import CLIError, build_parser, spec_from_args
from triforce.engine import Engine
from triforce.plan import DRAFT_PREFILL_CHUNK, size_caches, size_request
from triforce.speculation.hierarchy import KIND_OPTIONS, PRESETS, SpeculationConfig, TierSpec


def test_presets_expand_to_tier_specs_with_each_kinds_own_options():
    spec = SpeculationConfig(mode="triforce", drafter="ngram", gamma1=3, gamma2=5, budget=64, ngram_n=5)
    tiers = spec.tier_specs
    assert [(t.kind, t.gamma) for t in tiers] == [("ngram", 3), ("retrieval", 5)] == spec.chain
    assert tiers[0] == TierSpec("ngram", 3, {"ngram_n": 5, "ngram_min": 3})
    assert set(tiers[1].options) == set(KIND_OPTIONS["retrieval"]) and tiers[1].options["budget"] == 64
    assert SpeculationConfig(mode="autoregressive").tier_specs == ()
    for mode in PRESETS:  # every preset is a list of tiers; explicit tiers give the same specs
        s = SpeculationConfig(mode=mode, drafter="self")
        assert SpeculationConfig(tiers=",".join(f"{k}:{g}" for k, g in s.chain) or None).tier_specs == s.tier_specs \
            or not s.chain


@pytest.mark.parametrize("argv, refused, reason", [
    (["--mode", "autoregressive", "--budget", "64"], "--budget", "a retrieval tier"),
    (["--mode", "retrieval", "--gamma1", "2"], "--gamma1", "--mode triforce"),
    (["--mode", "retrieval", "--ngram-n", "2"], "--ngram-n", "a ngram tier"),
    (["--tiers", "self:4", "--draft", "self", "--lower-weights", "int8"], "--lower-weights", "draft or retrieval"),
    (["--tiers", "retrieval:4", "--gamma2", "3"], "--gamma2", "each entry gives its gamma"),
])
def test_unused_options_are_refused_at_parse_time_with_the_reason(argv, refused, reason):
    args = build_parser().parse_args(["generate", *argv])
    with pytest.raises(CLIError) as e:
        spec_from_args(args, has_draft=args.draft is not None)
    msg = str(e.value)
    assert msg.startswith(refused) and "not used by" in msg and reason in msg and len(msg.splitlines()) == 1


def test_auto_and_used_options_pass():
    for argv in (["--budget", "64", "--ngram-n", "2", "--gamma1", "2"],  # auto keeps everything
                 ["--tiers", "self:4", "--draft", "self", "--lower-kv-dtype", "bfloat16", "--draft-window", "32"],
                 ["--mode", "retrieval", "--budget", "64", "--chunk-score", "max", "--adaptive-gamma"]):
        args = build_parser().parse_args(["generate", *argv])
        spec_from_args(args, has_draft=args.draft is not None)


def test_the_request_plan_sizes_every_cache_once():
    target, draft = pair(seed=0)
    spec = SpeculationConfig(mode="triforce", budget=32, chunk_size=4, gamma1=2, gamma2=3, draft_window=16,
                             lower_weights="int8")
    plan = size_caches(target, draft, spec, 40, 10, torch.float32)
    full, lookahead, draft_slots = size_request(40, 10, spec)
    assert (plan.full_capacity, plan.lookahead, plan.draft_capacity) == (full, lookahead, draft_slots)
    assert plan.full_capacity == 40 + 10 + 3 + 1 and plan.lookahead == 2 + 3 + 2 + 1
    assert plan.draft_capacity == spec.draft_sink + 16 + plan.lookahead + DRAFT_PREFILL_CHUNK
    assert plan.streaming_extra == plan.lookahead + DRAFT_PREFILL_CHUNK
    assert set(plan.cache_bytes) == {"full KV cache", "retrieval cache", "draft cache",
                                     "int8 copies of the lower tiers' weights"}
    assert plan.placement is None
    engine = Engine(target, draft)
    assert dict(engine.plan(list(range(3, 43)), 10, spec).cache_bytes) == dict(plan.cache_bytes)
    assert engine.plan(list(range(3, 43)), 10, spec) == plan  # the engine plans with the same function


def test_planning_leaves_the_engine_alone():
    target, _ = pair(seed=0)
    engine = Engine(target, offload_kv=True, on_chip_layers=1)
    spec = SpeculationConfig(mode="retrieval", budget=16, chunk_size=4, gamma2=3)
    before = dict(vars(engine))
    plan = engine.plan(list(range(3, 40)), 12, spec)
    assert plan.placement.on_chip_layers == 1 and engine.plan(list(range(3, 40)), 12, spec).placement == plan.placement
    assert {k: v for k, v in vars(engine).items()} == before and engine.full_cache is None


def test_public_hooks_replace_private_fields():
    from triforce.kv.caches import FullKVCache

    target, _ = pair(seed=0)
    engine = Engine(target)
    full = FullKVCache(target.cfg, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match="tokens"):
        engine.adopt_prefix(full, [1, 2])  # the cache holds no position yet
    engine.adopt_prefix(full, [])
    assert engine.full_cache is full and engine.prefix_tokens == []
    engine.forget_prefix()
    assert engine.full_cache is None
    assert engine.lower_model(target, None) is target


def test_the_plan_counts_the_draft_cache_in_the_dtype_the_engine_allocates():
    """bf16 target and draft with an fp32 KV cache: the draft's StreamingLLM cache is fp32, in the plan as in the
    engine."""
    from triforce.kv.caches import kv_bytes
    from triforce.speculation.sampling import SamplingParams

    target, draft = (m.to(torch.bfloat16) for m in pair(seed=0))
    spec = SpeculationConfig(mode="draft", gamma2=3, draft_window=16)
    engine = Engine(target, draft, kv_dtype="float32")
    plan = engine.plan(list(range(3, 43)), 10, spec)
    assert plan.cache_bytes["draft cache"] == kv_bytes(draft.cfg, plan.draft_capacity, torch.float32)
    top = engine.build_hierarchy(plan, SamplingParams(temperature=0), torch.Generator())
    assert top.drafter.cache.k.dtype == torch.float32


def test_a_huge_gamma_is_capped_at_what_the_request_can_use():
    """``gamma2=100_000`` with 8 new tokens: no verification can ask for more than 7 proposals, so every gamma is
    capped at max_new_tokens - 1 per request; the caches are sized for the cap (they were sized for 100,000
    positions ahead: 42.9 GiB for SmolLM2), the stats report the gamma used, and the output is the same."""
    from triforce.speculation.sampling import SamplingParams

    greedy = SamplingParams(temperature=0)
    target, draft = pair(seed=0)
    engine = Engine(target, draft)
    prompt = list(range(3, 43))
    huge = SpeculationConfig(mode="draft", gamma2=100_000, draft_window=16)
    capped = SpeculationConfig(mode="draft", gamma2=7, draft_window=16)
    assert huge.for_request(8) == capped and capped.for_request(8) is capped
    assert huge.for_request(1).gamma2 == 1  # at least 1
    tiers = SpeculationConfig(tiers="ngram:50,draft:3,retrieval:900", budget=4096).for_request(8)
    assert tiers.chain == [("ngram", 7), ("draft", 3), ("retrieval", 7)]
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1"):
        huge.for_request(0)
    assert size_request(40, 8, huge) == size_request(40, 8, capped)
    assert size_caches(target, draft, huge, 40, 8, torch.float32).cache_bytes == \
        size_caches(target, draft, capped, 40, 8, torch.float32).cache_bytes
    plan = engine.plan(prompt, 8, huge, sampling=greedy)
    assert plan.spec.gamma2 == 7 and plan.full_capacity == 40 + 8 + 7 + 1
    out, stats = engine.generate(prompt, max_new_tokens=8, sampling=greedy, spec=huge)
    assert stats.tiers["target"]["gamma"] == 7
    assert out == engine.generate(prompt, max_new_tokens=8, sampling=greedy, spec=SpeculationConfig())[0]
    auto = engine.generate(prompt, max_new_tokens=8, sampling=greedy,
                           spec=SpeculationConfig(mode="auto", drafter="ngram", gamma2=1000))[1]
    assert auto.auto["hierarchy"] == "ngram:7" and auto.tiers["target"]["gamma"] == 7
