"""Selection rules of the retrieval cache (issue 15): the ``attn`` rule against a brute-force reference, and every
rule lossless (greedy equality with autoregressive decoding; exact distribution by a chi-square test, p > 1e-3)."""

import math

import pytest
import torch

from distribution import N_FEATURE, chi2_pvalue, empirical, exact_distribution
from distribution import SETTINGS as DIST_SETTINGS
from tiny import pair, random_prompts
from triforce.engine import Engine, SpeculationConfig
from triforce.kv.caches import FullKVCache
from triforce.kv.retrieval import CHUNK_SCORES, RetrievalCache, attention_mass_scores, recent_queries
from triforce.speculation.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0)


def _filled(seed=0, n=37, L=2, nkv=2, g=3, hs=8):
    """A tiny config and a full cache holding n random post-RoPE keys/values, recording queries of a 5-token block."""
    from triforce.model.config import ModelConfig

    cfg = ModelConfig(model_type="llama", head_dim=hs, vocab_size=16, hidden_size=nkv * g * hs, intermediate_size=16,
                      num_hidden_layers=L, num_attention_heads=nkv * g, num_key_value_heads=nkv)
    gen = torch.Generator().manual_seed(seed)
    full = FullKVCache(cfg, n + 8, record_queries=True)
    full.k[:, :, :, :n] = torch.randn(L, 1, nkv, n, hs, generator=gen) * 2
    full.v[:, :, :, :n] = torch.randn(L, 1, nkv, n, hs, generator=gen)
    full.k[..., 0] += 6.0  # a massive channel shared by every key, as a k bias gives
    full.length = n
    full.query_start = n - 4  # the last forward: positions n-4 .. n (position n is the next token's)
    full.queries = [torch.randn(1, nkv * g, 5, hs, generator=gen) * (1 + 3 * torch.arange(nkv * g)[None, :, None, None])
                    for _ in range(L)]
    return cfg, full


def _reference_order(full, query_window, length, chunk, budget, recent):
    """Brute force, loops only: each (layer, KV head)'s ranking under the ``attn`` rule."""
    L, _, nkv, _, hs = full.k.shape
    nh = full.queries[0].shape[1]
    g = nh // nkv
    out = torch.empty(L, nkv, min(budget, length), dtype=torch.long)
    for layer in range(L):
        for kv in range(nkv):
            mass = [0.0] * length
            for h in range(kv * g, kv * g + g):
                for w in range(query_window):
                    pos = length - query_window + 1 + w
                    q = full.queries[layer][0, h, pos - full.query_start].double()
                    logits = [float(q @ full.k[layer, 0, kv, j].double()) / math.sqrt(hs) if j <= pos else -math.inf
                              for j in range(length)]
                    mx = max(logits)
                    e = [math.exp(x - mx) for x in logits]
                    for j in range(length):
                        mass[j] += e[j] / sum(e)
            chunk_score = [sum(mass[c * chunk:(c + 1) * chunk]) for c in range(math.ceil(length / chunk))]
            key = []
            for j in range(length):
                first = j < chunk or j >= length - recent
                key.append((0 if first else 1, -chunk_score[j // chunk] if not first else 0, j))
            out[layer, kv] = torch.tensor([j for *_, j in sorted(key)][:min(budget, length)])
    return out


@pytest.mark.parametrize("window,recent,chunk", [(1, 0, 4), (4, 0, 3), (5, 6, 4), (3, 7, 1)])
def test_attn_selection_matches_brute_force(window, recent, chunk):
    cfg, full = _filled()
    n = full.length
    cache = RetrievalCache(cfg, full, 20, chunk, "attn", recent=recent, query_window=window)
    cache.build_from_full(n)
    ref = _reference_order(full, window, n, chunk, 20, recent)
    got = cache.selected[:, 0, :, :20]
    assert torch.equal(got.sort(-1).values, ref.sort(-1).values)
    assert torch.equal(cache.k[:, :, :, :20], torch.gather(full.k[:, :, :, :n], 3, got[:, None, :, :, None].expand(
        -1, 1, -1, -1, full.k.shape[-1])))


def test_attention_mass_scores_each_head_weighs_the_same():
    """Scaling one head's query (massive activations) changes nothing in the other heads' share: each head sums to 1."""
    gen = torch.Generator().manual_seed(3)
    keys, q = torch.randn(10, 4, generator=gen), torch.randn(3, 4, generator=gen)
    pos = torch.tensor([9, 9, 9])
    s = attention_mass_scores(keys, q, pos)
    assert torch.allclose(s.sum(), torch.tensor(3.0))
    ref = sum(torch.softmax(q[i] @ keys.T / 2.0, -1) for i in range(3))
    assert torch.allclose(s, ref, atol=1e-6)
    masked = attention_mass_scores(keys, q, torch.tensor([2, 9, 9]))
    first = torch.softmax(q[0] @ keys[:3].T / 2.0, -1)  # the query at position 2 sees keys 0..2 only
    ref_masked = sum(torch.softmax(q[i] @ keys.T / 2.0, -1) for i in (1, 2))
    ref_masked[:3] += first
    assert torch.allclose(masked, ref_masked, atol=1e-6)


def test_recent_queries_returns_the_window_of_the_last_forward():
    _, full = _filled()
    n = full.length
    q = recent_queries(full, n, 3)
    assert q.shape == (2, 1, 6, 3, 8)
    assert torch.equal(q[:, :, :, -1], full.query_at(n)) and torch.equal(q[:, :, :, 0], full.query_at(n - 2))
    assert recent_queries(full, n - 3, 8).shape[3] == 2  # only what the last forward recorded


def test_paper_rule_unchanged_by_the_window_machinery():
    """``mean`` with the default (1 query, no recent window) equals the ranking by q . mean key with chunk 0 first."""
    cfg, full = _filled(seed=4)
    n, c = full.length, 4
    cache = RetrievalCache(cfg, full, 16, c, "mean")
    assert cache.recent == 0 and cache.query_window == 1
    cache.build_from_full(n)
    q = full.query_at(n)  # (L, 1, nh, hs)
    for layer in range(2):
        for kv in range(2):
            means = [full.k[layer, 0, kv, i:min(i + c, n)].mean(0) for i in range(0, n, c)]
            sc = [float(sum(q[layer, 0, h] @ m for h in range(kv * 3, kv * 3 + 3))) for m in means]
            sc[0] = math.inf
            order = sorted(range(n), key=lambda j: (-sc[j // c], j))[:16]
            assert cache.selected[layer, 0, kv, :16].tolist() == order


@pytest.mark.parametrize("score", CHUNK_SCORES)
def test_every_rule_with_refresh_keeps_greedy_equality(tiny_engine, score):
    """Each rule, with the verification-guided refresh (rebuild every 5 tokens from the verifier's queries)."""
    for prompt in random_prompts(6, seed=15):
        ref, _ = tiny_engine.generate(prompt, max_new_tokens=30, sampling=GREEDY, spec=SpeculationConfig())
        for mode in ("retrieval", "triforce"):
            spec = SpeculationConfig(mode=mode, budget=24, chunk_size=4, gamma1=2, gamma2=4, chunk_score=score,
                                     rebuild_every=5, draft_sink=2, draft_window=6)
            out, stats = tiny_engine.generate(prompt, max_new_tokens=30, sampling=GREEDY, spec=spec)
            assert out == ref, (score, mode, prompt)
            if len(prompt) > 24:
                assert stats.tiers["retrieval"]["rebuilds"] >= 30 // 5


def test_attn_rule_prefix_reuse_gives_the_same_tokens_as_cold():
    """The query window is re-recorded on reuse: a warm engine selects exactly as a cold one."""
    target, draft = pair(seed=0)
    warm = Engine(target, draft)
    spec = SpeculationConfig(mode="retrieval", budget=24, chunk_size=4, gamma2=4, chunk_score="attn")
    for prompt in random_prompts(4, seed=3):
        out_w, st_w = warm.generate(prompt, max_new_tokens=20, sampling=GREEDY, spec=spec)
        out_c, st_c = Engine(target, draft, reuse_prefix=False).generate(prompt, max_new_tokens=20, sampling=GREEDY,
                                                                          spec=spec)
        assert out_w == out_c and st_w.tiers["target"]["accepted"] == st_c.tiers["target"]["accepted"]


@pytest.mark.parametrize("mode,setting", [  # the full hierarchy with the warped setting in every run (CI time)
    pytest.param(mode, setting, marks=() if (mode, setting) == ("triforce", "T0.6-p0.9-k5") else pytest.mark.slow)
    for mode in ("retrieval", "triforce") for setting in DIST_SETTINGS])
def test_attn_rule_matches_exact_distribution(distribution_models, mode, setting):
    """Chi-square goodness of fit over the 125 sequences, p > 1e-3 (fixed seed), with refresh every 2 tokens."""
    hf, target, draft, prompt = distribution_models
    params = DIST_SETTINGS[setting]
    spec = SpeculationConfig(mode=mode, budget=8, chunk_size=2, gamma1=2, gamma2=2, draft_sink=2, draft_window=4,
                             chunk_score="attn", rebuild_every=2)
    counts = empirical(Engine(target, draft), prompt, params, spec, N_FEATURE, seed=1500 + len(setting) + len(mode))
    assert chi2_pvalue(counts, exact_distribution(hf, prompt, params)) > 1e-3


@pytest.mark.parametrize("n,budget", [(40, 96), (9, 64), (100, 128)])
def test_one_query_over_a_cache_with_empty_slots_matches_sdpa(n, budget):
    """A prompt shorter than the budget leaves slots between the selected and the generated ones empty: a decode step
    then attends over the two filled ranges with the kernel (merged by log-sum-exp) where it applies, and equals SDPA
    over every slot with the cache's mask within fp32 rounding, step after step."""
    from triforce.kernels.sdpa import gqa_attention

    cfg, full = _filled(n=n, hs=16)
    cache = RetrievalCache(cfg, full, budget, 8)
    cache.build(n, torch.randn(cfg.num_hidden_layers, 1, cfg.num_attention_heads, cfg.head_dim))
    gen = torch.Generator().manual_seed(n)
    for step in range(4):
        cache.begin_forward(torch.tensor([n + step]))
        assert cache._mask is not None  # empty slots: not every slot is visible
        for layer in range(cfg.num_hidden_layers):
            q = torch.randn(1, cfg.num_attention_heads, 1, cfg.head_dim, generator=gen)
            k = torch.randn(1, cfg.num_key_value_heads, 1, cfg.head_dim, generator=gen)
            v = torch.randn(1, cfg.num_key_value_heads, 1, cfg.head_dim, generator=gen)
            out = cache.attend(layer, q, k, v, q)
            ref = gqa_attention(q.double(), cache.k[layer].double(), cache.v[layer].double(), cache._mask)
            torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
        cache.end_forward()
