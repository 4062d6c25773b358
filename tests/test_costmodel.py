"""Cost model (expected tokens, predicted time per token) and synthetic paper-shaped models / random KV caches."""

import math

import pytest
import torch
from transformers import LlamaConfig

from triforce.engine import Engine, SpeculationConfig
from triforce.kv.caches import FullKVCache
from triforce.kv.retrieval import RetrievalCache
from triforce.kv.streaming import StreamingCache
from triforce.lab.costmodel import expected_tokens, measure_tier_latencies, predict
from triforce.lab.synthetic import SYNTHETIC_SHAPES, fill_random_kv, random_model, random_query, synthetic_config
from triforce.model.config import ModelConfig
from triforce.speculation.sampling import SamplingParams


def tiny_cfg(**kw) -> ModelConfig:
    """A small GQA Llama config (4 query heads, 2 KV heads) for cache tests."""
    d = dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=4096)
    d.update(kw)
    return ModelConfig(**d)


# ------------------------------------------------------------------------------------------ expected tokens
def test_expected_tokens_exact_values():
    assert expected_tokens(0.5, 3) == pytest.approx(1.875)  # 1 + .5 + .25 + .125
    assert expected_tokens(0.8, 4) == pytest.approx(1 + 0.8 + 0.64 + 0.512 + 0.4096)
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.0, 6) == 1.0
    assert expected_tokens(0.9, 0) == pytest.approx(1.0)


@pytest.mark.parametrize("alpha, gamma", [(-0.1, 2), (1.5, 2), ("0.5", 2), (0.5, -1), (0.5, 2.0), (0.5, True)])
def test_expected_tokens_rejects_bad_input(alpha, gamma):
    with pytest.raises(ValueError, match="alpha|gamma"):
        expected_tokens(alpha, gamma)


# ------------------------------------------------------------------------------------------ predict
LAT = {"draft_step": 0.002, "draft_pass": 0.003, "ngram_propose": 0.0001, "retrieval_decode": 0.010,
       "retrieval_pass": 0.012, "full_decode": 0.030, "full_pass": 0.036}


def E(a, g):
    return sum(a ** i for i in range(g + 1))


def test_predict_depth_1_matches_hand_formula_and_leviathan():
    p = predict([("draft", 4)], LAT, {"target": 0.8})
    c = (4 * 0.002 + 0.036) / E(0.8, 4)
    assert p["seconds_per_token"] == pytest.approx(c)
    assert p["speedup"] == pytest.approx(0.030 / c)
    assert p["tiers"][0]["name"] == "target" and p["tiers"][0]["verifies"] == "draft"
    # with a verification pass as costly as a decode, it is Leviathan et al.'s factor E / (gamma c + 1)
    lat = dict(LAT, full_pass=LAT["full_decode"])
    ratio = 0.002 / 0.030
    assert predict([("draft", 4)], lat, {"target": 0.8})["speedup"] == pytest.approx(E(0.8, 4) / (4 * ratio + 1))


def test_predict_depth_2_and_3_match_hand_formula():
    acc = {"draft": 0.5, "retrieval": 0.9, "target": 0.7}
    p = predict([("draft", 4), ("retrieval", 6)], LAT, acc)
    c1 = (4 * 0.002 + 0.012) / E(0.9, 4)
    c2 = (6 * c1 + 0.036) / E(0.7, 6)
    assert [t["seconds_per_token"] for t in p["tiers"]] == pytest.approx([c1, c2])
    assert p["seconds_per_token"] == pytest.approx(c2) and p["speedup"] == pytest.approx(0.030 / c2)

    p3 = predict([("ngram", 8), ("draft", 4), ("retrieval", 6)], LAT, acc)
    d1 = (0.0001 + 0.003) / E(0.5, 8)
    d2 = (4 * d1 + 0.012) / E(0.9, 4)
    d3 = (6 * d2 + 0.036) / E(0.7, 6)
    assert p3["seconds_per_token"] == pytest.approx(d3)
    assert [t["name"] for t in p3["tiers"]] == ["draft", "retrieval", "target"]

    p_ret = predict([("retrieval", 6)], LAT, {"target": 0.7})  # retrieval mode: the retrieval tier decodes 6 tokens
    assert p_ret["seconds_per_token"] == pytest.approx((6 * 0.010 + 0.036) / E(0.7, 6))
    assert predict([], LAT, {})["speedup"] == 1.0


def test_predict_engine_schedule_by_hand():
    """tiers.py: a retrieval tier asked for 6 tokens with gamma1 = 4 runs a 4-draft step and then what is left."""
    # everything accepted: one step of 4 drafts emits 5, then a 1-token decode
    p = predict([("draft", 4), ("retrieval", 6)], LAT, {"retrieval": 1.0, "target": 1.0})
    q6 = 4 * 0.002 + 0.012 + 0.010
    assert p["engine_seconds_per_token"] == pytest.approx((q6 + 0.036) / 7)
    # nothing accepted: each step emits 1 token; drafts per step 4, 4, 3, 2, 1, then a decode
    p0 = predict([("draft", 4), ("retrieval", 6)], LAT, {"retrieval": 0.0, "target": 0.0})
    q6 = 14 * 0.002 + 5 * 0.012 + 0.010
    assert p0["engine_seconds_per_token"] == pytest.approx(q6 + 0.036)
    # with measured block sizes, a 3-token block costs the linear interpolation of decode (1) and pass (5 tokens)
    lat = dict(LAT, blocks={"retrieval_pass": 5, "full_pass": 7})
    p2 = predict([("draft", 2), ("retrieval", 6)], lat, {"retrieval": 1.0, "target": 1.0})
    v3 = 0.010 + (0.012 - 0.010) * 2 / 4
    assert p2["engine_seconds_per_token"] == pytest.approx((2 * (2 * 0.002 + v3) + 0.036) / 7)  # 3 + 3 tokens


@pytest.mark.parametrize("chain, acc, match", [
    ([("draft", 4), ("retrieval", 6)], {"target": 0.5}, "acceptance\\['retrieval'\\]"),
    ([("draft", 4)], {"target": 1.2}, "acceptance\\['target'\\]"),
    ([("draft", 0)], {"target": 0.5}, "gamma"),
    ([("retrieval", 2), ("ngram", 3)], {"ngram": 0.5, "target": 0.5}, "ngram"),
    ([("oracle", 2)], {"target": 0.5}, "kind"),
])
def test_predict_rejects_bad_input(chain, acc, match):
    with pytest.raises(ValueError, match=match):
        predict(chain, LAT, acc)


def test_predict_names_a_missing_latency():
    with pytest.raises(ValueError, match="draft_step"):
        predict([("draft", 4)], {"full_decode": 0.03, "full_pass": 0.04}, {"target": 0.5})


# ------------------------------------------------------------------------------------------ synthetic shapes
def test_synthetic_config_shapes():
    c = synthetic_config("llama2-7b")
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
            c.intermediate_size, c.vocab_size, c.max_position_embeddings) == \
        (4096, 32, 32, 32, 128, 11008, 32000, 131072)
    assert c.rope_type == "default" and c.rope_parameters["rope_theta"] == 10000.0
    assert synthetic_config("llama2-7b", layers=2).num_hidden_layers == 2
    c8 = synthetic_config("llama3.1-8b")
    assert (c8.num_key_value_heads, c8.vocab_size, c8.intermediate_size, c8.rope_type) == (8, 128256, 14336, "llama3")
    d = synthetic_config("llama-68m")
    assert (d.hidden_size, d.num_hidden_layers, d.num_attention_heads, d.intermediate_size, d.vocab_size) == \
        (768, 2, 12, 3072, 32000)
    assert synthetic_config("llama-68m", vocab_size=128256).vocab_size == 128256
    for name, shape in SYNTHETIC_SHAPES.items():  # what transformers reads from the same config.json fields
        assert synthetic_config(name) == ModelConfig.from_hf(LlamaConfig(**shape))


def test_synthetic_config_rejects_unknown_names_and_bad_layers():
    with pytest.raises(ValueError, match="llama2-7b, llama3.1-8b, llama-68m"):
        synthetic_config("llama2-70b")
    with pytest.raises(ValueError, match="layers"):
        synthetic_config("llama2-7b", layers=0)


def test_random_model_is_labelled_and_seeded():
    m = random_model(synthetic_config("llama-68m", layers=1), seed=3)
    assert m.synthetic is True and m.synthetic_shape == "llama-68m" and m.name == "synthetic llama-68m (1 of 2 layers)"
    w = m.layers[0].self_attn.qkv_proj.weight_t
    assert w.std().item() == pytest.approx(0.02, rel=0.02)
    assert torch.equal(m.layers[0].input_layernorm.weight, torch.ones(768))
    m2 = random_model(synthetic_config("llama-68m", layers=1), seed=3)
    assert torch.equal(w, m2.layers[0].self_attn.qkv_proj.weight_t)
    assert random_model(tiny_cfg()).name == "synthetic custom (2 layers)"


# ------------------------------------------------------------------------------------------ random KV caches
class RecordingCache(FullKVCache):
    """Keeps each layer's query and attention output of the last forward."""

    def attend(self, layer, q, k, v, q_pre):
        out = super().attend(layer, q, k, v, q_pre)
        self.seen = getattr(self, "seen", {})
        self.seen[layer] = (q.clone(), out.clone())
        return out


def test_fill_random_kv_full_cache_is_attended_as_stored():
    cfg = tiny_cfg()
    model = random_model(cfg, std=0.2)
    cache = RecordingCache(cfg, 64, torch.float32, "cpu")
    fill_random_kv(cache, 40, seed=1)
    assert cache.length == 40
    filled = cache.k[:, :, :, :40].clone(), cache.v[:, :, :, :40].clone()
    assert filled[0].std().item() == pytest.approx(1.0, rel=0.15)
    logits = model(torch.tensor([[5]]), torch.tensor([40]), cache)
    assert cache.length == 41 and torch.isfinite(logits).all()
    assert torch.equal(cache.k[:, :, :, :40], filled[0]) and torch.equal(cache.v[:, :, :, :40], filled[1])
    g = cfg.num_kv_groups
    for layer in range(cfg.num_hidden_layers):  # attention over the 40 random keys + the new one, computed by hand
        q, out = cache.seen[layer]
        k = cache.k[layer, :, :, :41].repeat_interleave(g, dim=1)
        v = cache.v[layer, :, :, :41].repeat_interleave(g, dim=1)
        ref = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(cfg.head_dim), -1) @ v
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # the same fill gives the same cache and the same logits; rollback keeps the context
    cache.rollback(40)
    again = FullKVCache(cfg, 64, torch.float32, "cpu")
    fill_random_kv(again, 40, seed=1)
    assert torch.equal(again.k[:, :, :, :40], filled[0])
    torch.testing.assert_close(model(torch.tensor([[5]]), torch.tensor([40]), again), logits, rtol=0, atol=0)
    other = FullKVCache(cfg, 64, torch.float32, "cpu")
    fill_random_kv(other, 40, seed=2)
    assert not torch.equal(other.k[:, :, :, :40], filled[0])


def test_fill_random_kv_retrieval_and_streaming_caches():
    cfg = tiny_cfg()
    model = random_model(cfg, std=0.2)
    full = FullKVCache(cfg, 80, torch.float32, "cpu")
    fill_random_kv(full, 70, seed=1)
    ref = model(torch.tensor([[7, 8]]), torch.arange(70, 72), full)
    full.rollback(70)
    # a retrieval cache whose budget holds every position attends exactly like the full cache
    everything = RetrievalCache(cfg, full, budget=96, chunk_size=8)
    fill_random_kv(everything, 70, seed=5)
    assert everything.length == 70 and everything.holds_everything
    torch.testing.assert_close(model(torch.tensor([[7, 8]]), torch.arange(70, 72), everything), ref,
                               rtol=1e-5, atol=1e-5)
    # a small budget selects with the random query (TriForce Sec. 4.1): chunk 0 always kept
    small = RetrievalCache(cfg, full, budget=24, chunk_size=8)
    small.build(70, random_query(cfg, 1, seed=5))
    assert small.length == 70 and set(range(8)) <= set(small.selected[0, 0, 0].tolist())
    # StreamingLLM cache: sinks + the last window positions, as the policy would keep them
    sc = StreamingCache(cfg, sink=4, window=16, slack=8, rope=model.rope)
    fill_random_kv(sc, 300, seed=3)
    assert sc.length == 300 and sc.visible_positions(300) == list(range(4)) + list(range(285, 300))
    a = model(torch.tensor([[9, 10, 11]]), torch.arange(300, 303), sc)
    sc.rollback(300)
    torch.testing.assert_close(model(torch.tensor([[9, 10, 11]]), torch.arange(300, 303), sc), a, rtol=0, atol=0)
    with pytest.raises(ValueError, match="length"):
        fill_random_kv(FullKVCache(cfg, 10), 11)


# ------------------------------------------------------------------------------------------ engine + latencies
def test_random_model_runs_the_engine_with_greedy_equality():
    target = random_model(synthetic_config("llama-68m"), seed=0)
    draft = random_model(synthetic_config("llama-68m", layers=1), seed=1)
    engine = Engine(target, draft, eos_ids=())
    prompt = torch.randint(3, 32000, (90,), generator=torch.Generator().manual_seed(0)).tolist()
    outs = {}
    for mode in ("autoregressive", "retrieval", "triforce"):
        spec = SpeculationConfig(mode=mode, budget=32, gamma1=2, gamma2=4, chunk_size=4)
        outs[mode], stats = engine.generate(prompt, max_new_tokens=12, sampling=SamplingParams(temperature=0.0),
                                            spec=spec, seed=0)
        assert stats.generated_tokens == 12
    assert outs["retrieval"] == outs["autoregressive"] and outs["triforce"] == outs["autoregressive"]


def test_measure_tier_latencies_shape_and_rollback():
    cfg = tiny_cfg()
    target, draft = random_model(cfg, seed=0), random_model(tiny_cfg(num_hidden_layers=1), seed=1)
    ticks = []
    rows = measure_tier_latencies(target, draft, [50, 120], gamma1=2, gamma2=3, budget=32, chunk_size=4,
                                  draft_sink=4, draft_window=16, reps=2, progress=ticks.append)
    assert [r["context"] for r in rows] == [50, 120]
    assert len(ticks) == 2 * 2 * 7
    for r in rows:
        assert all(r[k] is not None and r[k] > 0 for k in ("draft_step", "draft_pass", "retrieval_pass",
                                                           "retrieval_decode", "full_pass", "full_decode"))
        assert r["blocks"]["full_pass"] == 4 and r["blocks"]["retrieval_pass"] == 3
        assert r["bytes"]["full_kv"] == 2 * 2 * 2 * r["context"] * 8 * 4
    no_draft = measure_tier_latencies(target, None, [50], gamma1=2, gamma2=3, budget=32, chunk_size=4, reps=1)
    assert no_draft[0]["draft_step"] is None and no_draft[0]["ngram_propose"] is not None
    with pytest.raises(ValueError, match="budget"):
        measure_tier_latencies(target, None, [50], budget=8)
    with pytest.raises(ValueError, match="contexts"):
        measure_tier_latencies(target, None, [0])


def test_measure_tier_latencies_times_the_lower_copy_and_token_selection(monkeypatch):
    """``lower`` runs the retrieval steps in the same loop as the verifier's; ``sampling`` adds each step's token
    selection (the engine's own functions, once per timed call: warm-up + reps, every model kind)."""
    import triforce.lab.costmodel as cm
    from triforce.model.quant import lower_precision_copy

    target = random_model(tiny_cfg(), seed=0)
    lower = lower_precision_copy(target, "int8")
    calls = {"target": 0, "lower": 0, "select": 0, "rows": []}
    for name, model in (("target", target), ("lower", lower)):
        orig = model.forward

        def counted(*a, _orig=orig, _name=name, **kw):
            calls[_name] += 1
            return _orig(*a, **kw)
        monkeypatch.setattr(model, "forward", counted)
    real_select = cm.rejection_sample

    def select(d, q, p, gen, greedy=False):
        calls["select"] += 1
        calls["rows"].append(p.shape[1])
        assert q.shape[1] == d.shape[1] == p.shape[1] - 1 and torch.allclose(p.sum(-1), torch.ones(p.shape[:2]))
        return real_select(d, q, p, gen, greedy=greedy)
    monkeypatch.setattr(cm, "rejection_sample", select)
    row = measure_tier_latencies(target, None, [50], gamma1=2, gamma2=3, budget=32, chunk_size=4, reps=2,
                                 lower=lower, sampling=SamplingParams(temperature=0.7, top_p=0.9))[0]
    assert calls["target"] == 2 * 3 and calls["lower"] == 2 * 3  # full_decode/full_pass; retrieval_decode/_pass
    assert calls["select"] == 4 * 3 and sorted(set(calls["rows"])) == [1, 3, 4]  # 1-token steps, gamma1+1, gamma2+1
    assert row["token_selection"] is True and row["bytes"]["lower_weights"] < row["bytes"]["target_weights"]
    plain = measure_tier_latencies(target, None, [50], gamma1=2, gamma2=3, budget=32, chunk_size=4, reps=1)[0]
    assert plain["token_selection"] is False and plain["bytes"]["lower_weights"] == plain["bytes"]["target_weights"]
    assert calls["select"] == 4 * 3  # no sampling: forwards only
    # real text's distributions instead of the forward's: each step takes the next rows of selection_logits, cycling
    text = cm.text_logits(target, list(range(3, 10)))  # (7, V)
    assert text.shape == (7, 64) and torch.allclose(text[-1], cm.text_logits(target, list(range(3, 10)))[-1])
    seen = []
    real_l2p = cm.logits_to_probs
    monkeypatch.setattr(cm, "logits_to_probs", lambda x, sp: seen.append(x.clone()) or real_l2p(x, sp))
    measure_tier_latencies(target, None, [50], gamma1=2, gamma2=3, budget=32, chunk_size=4, reps=1,
                           sampling=SamplingParams(temperature=0.7, top_p=0.9), selection_logits=text)
    fed = torch.cat(seen)  # every row the selection saw, in order: text's rows 0..6, 0..6, ...
    assert torch.equal(fed, text[torch.arange(fed.shape[0]) % 7])
    with pytest.raises(ValueError, match="selection_logits must be a \\(rows, 64\\) tensor"):
        measure_tier_latencies(target, None, [50], budget=32, chunk_size=4, selection_logits=torch.zeros(3, 10))
    with pytest.raises(ValueError, match="ids must be a non-empty list of token ids in \\[0, 64\\)"):
        cm.text_logits(target, [1, 64])
    with pytest.raises(ValueError, match="lower must be .* the target's config"):
        measure_tier_latencies(target, None, [50], budget=32, chunk_size=4,
                               lower=random_model(tiny_cfg(hidden_size=16)))
    with pytest.raises(ValueError, match="sampling must be a SamplingParams"):
        measure_tier_latencies(target, None, [50], budget=32, chunk_size=4, sampling=0.7)


def test_measure_tier_latencies_times_the_lower_caches_in_their_dtype(monkeypatch):
    """lower_kv (--lower-kv-dtype): the retrieval and draft caches timed are allocated in it, and their bytes say so."""
    import triforce.lab.costmodel as cm

    made = []
    for name in ("RetrievalCache", "StreamingCache"):
        real = getattr(cm, name)  # bound as the lambda's default: this iteration's class
        monkeypatch.setattr(cm, name, lambda *a, _cls=real, **k: made.append(_cls(*a, **k)) or made[-1])
    target, draft = random_model(tiny_cfg(), seed=0), random_model(tiny_cfg(num_hidden_layers=1), seed=1)
    kw = dict(gamma1=2, gamma2=3, budget=32, chunk_size=4, draft_sink=4, draft_window=16, reps=1)
    low = measure_tier_latencies(target, draft, [50], lower_kv=torch.bfloat16, **kw)[0]
    assert [c.k.dtype for c in made] == [torch.bfloat16, torch.bfloat16]
    plain = measure_tier_latencies(target, draft, [50], **kw)[0]
    assert [c.k.dtype for c in made[2:]] == [torch.float32, torch.float32]
    for key in ("retrieval_kv", "draft_kv"):
        assert 2 * low["bytes"][key] == plain["bytes"][key] > 0
    assert low["bytes"]["full_kv"] == plain["bytes"]["full_kv"]  # the verifier's cache keeps its dtype
    with pytest.raises(ValueError, match="lower_kv must be a torch dtype"):
        measure_tier_latencies(target, None, [50], budget=32, chunk_size=4, lower_kv="bfloat16")


def test_observed_run_lengths_replace_the_independent_model():
    """Acceptance in runs: with the same rate, the observed run lengths give the tokens per verification exactly."""
    from triforce.lab.costmodel import accepted_length_distribution, predict

    # 10 verifications of gamma 4 drafts: 7 accept all 4, 3 accept none -> rate 28/40 = 0.7, 3.1 + 0.7... tokens each
    counts = [3, 0, 0, 0, 7]
    dist = accepted_length_distribution(0.7, 4, counts)
    assert dist == pytest.approx([0.3, 0, 0, 0, 0.7])
    lat = {"full_decode": 1.0, "full_pass": 1.0, "ngram_propose": 0.0}
    iid = predict([("ngram", 4)], lat, {"target": 0.7})
    runs = predict([("ngram", 4)], lat, {"target": 0.7}, accepted_lengths={"target": counts})
    assert runs["tiers"][-1]["expected_tokens"] == pytest.approx(0.3 * 1 + 0.7 * 5)  # 3.8 tokens per verification
    assert iid["tiers"][-1]["expected_tokens"] == pytest.approx((1 - 0.7 ** 5) / 0.3)  # 2.77: the i.i.d. formula
    assert runs["speedup"] == pytest.approx(3.8) and runs["engine_speedup"] == pytest.approx(3.8)
    # longer runs than gamma fold onto gamma; no observations fall back to the formula
    assert accepted_length_distribution(0.5, 2, [1, 1, 1, 1]) == pytest.approx([0.25, 0.25, 0.5])
    assert accepted_length_distribution(0.5, 2, []) == pytest.approx([0.5, 0.25, 0.25])


def test_engine_records_accepted_lengths_consistent_with_its_counters():
    from tiny import pair
    from triforce.engine import Engine, SpeculationConfig
    from triforce.speculation.sampling import SamplingParams

    target, draft = pair(seed=11)
    _, stats = Engine(target, draft).generate(list(range(5, 60)), max_new_tokens=40, sampling=SamplingParams(1.0),
                                              spec=SpeculationConfig(mode="draft", gamma2=4), seed=3)
    t = stats.tiers["target"]
    hist = t["accepted_lengths"]
    assert sum(hist) == t["verifications"]
    assert sum(j * n for j, n in enumerate(hist)) == t["accepted"]


def test_batched_cost_model_follows_the_roofline_and_magicdecs_trend():
    """predict_batch (MagicDec, arXiv 2408.11049): at batch 1 with memory-bound steps it is Leviathan et al.'s
    improvement factor E / (gamma c + 1); at long context the speedup grows with the batch; fully compute-bound,
    speculation cannot pay (E / (2 gamma + 1))."""
    from triforce.lab.batchcost import batch_step_seconds, predict_batch

    # Llama-2-7B in bf16 on an A100: 13.5 GB of weights, 0.5 MB of KV per position, 13.4 GFLOP per token
    hw = dict(weight_bytes=13.5e9, kv_bytes_per_slot=2 * 32 * 32 * 128 * 2, flops_per_row=2 * 6.7e9,
              bandwidth=2.0e12, flops=312e12)
    one = predict_batch(1, 32768, 3, 0.8, 512, **hw)
    c = one["draft_step_seconds"] / one["autoregressive_step_seconds"]
    verify_ratio = one["verify_seconds"] / one["autoregressive_step_seconds"]
    assert abs(verify_ratio - 1) < 1e-3  # memory-bound: a 4-row pass costs a decode step
    assert abs(one["speedup"] - expected_tokens(0.8, 3) / (3 * c + verify_ratio)) < 1e-9
    speedups = [predict_batch(b, 32768, 3, 0.8, 512, **hw)["speedup"] for b in (1, 8, 32, 128)]
    assert speedups == sorted(speedups) and speedups[-1] > 1.5 * speedups[0]
    bound = predict_batch(16, 4096, 3, 0.8, 512, **dict(hw, flops=1e9))
    assert abs(bound["speedup"] - expected_tokens(0.8, 3) / 7) < 1e-6
    assert batch_step_seconds(2, 1, 100.0, 10, kv_bytes_per_slot=1.0, flops_per_row=1.0, bandwidth=10.0,
                              flops=1e9) == (100 + 2 * 10) / 10
    with pytest.raises(ValueError, match="batch"):
        predict_batch(0, 100, 3, 0.8, 16, **hw)
