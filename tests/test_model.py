"""Our forward pass against transformers: logits of every family and RoPE variant (fp32, max abs diff <= 1e-4),
and prefill + incremental decode against one full forward."""

import pytest
import torch

from tiny import hf_model, ours
from triforce.kv.caches import FullKVCache
from triforce.model.config import ModelConfig, UnsupportedModelError

VARIANTS = {
    "llama-default": dict(family="llama"),
    "llama-tied": dict(family="llama", tie=True),
    "llama-mha-bias": dict(family="llama", kv_heads=4, attention_bias=True, mlp_bias=True),
    "llama-linear": dict(family="llama", rope={"rope_type": "linear", "factor": 4.0}),
    "llama-dynamic": dict(family="llama", max_pos=64, rope={"rope_type": "dynamic", "factor": 2.0}),
    "llama-yarn": dict(family="llama", max_pos=256,
                       rope={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    "llama3": dict(family="llama", rope={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "mistral": dict(family="mistral", sliding_window=None),
    "qwen2": dict(family="qwen2", tie=True),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_match_transformers(name):
    hf = hf_model(seed=3, **VARIANTS[name])
    model = ours(hf)
    ids = torch.randint(0, 96, (1, 100), generator=torch.Generator().manual_seed(0))  # past max_pos for dynamic
    with torch.no_grad():
        ref = hf(ids).logits
    model.set_request_length(ids.shape[1])  # dynamic NTK: the request's length, as transformers uses for one pass
    cache = FullKVCache(model.cfg, 128)
    out = model(ids, torch.arange(100), cache)
    assert ref.abs().max() > 1.0  # logits are not near-flat
    assert (out - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("name", ["llama-default", "llama-yarn", "qwen2", "llama3"])
def test_incremental_decode_equals_full_forward(name):
    model = ours(hf_model(seed=4, **VARIANTS[name]))
    ids = torch.randint(0, 96, (1, 50), generator=torch.Generator().manual_seed(1))
    full = model(ids, torch.arange(50), FullKVCache(model.cfg, 64))
    cache = FullKVCache(model.cfg, 64)
    parts = [model(ids[:, :20], torch.arange(20), cache), model(ids[:, 20:27], torch.arange(20, 27), cache)]
    parts += [model(ids[:, i:i + 1], torch.tensor([i]), cache) for i in range(27, 50)]
    assert (torch.cat(parts, 1) - full).abs().max().item() <= 1e-4


def test_rollback_then_rewrite_equals_fresh():
    model = ours(hf_model(seed=5))
    ids = torch.randint(0, 96, (1, 30), generator=torch.Generator().manual_seed(2))
    cache = FullKVCache(model.cfg, 40)
    model(ids[:, :25], torch.arange(25), cache)
    cache.rollback(18)  # O(1): later writes overwrite the rejected entries
    out = model(ids[:, 18:30], torch.arange(18, 30), cache)
    ref = model(ids, torch.arange(30), FullKVCache(model.cfg, 40))[:, 18:]
    # fp32 rounding only (the 12-token block attends with csrc/attention.c, the 30-token prefill with SDPA); a stale
    # or misplaced entry would move the logits by O(1)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_no_worse_than_transformers(dtype):
    """In bf16/fp16 our logits stay as close to the fp32 logits as transformers' own do in that dtype."""
    hf = hf_model(seed=6)
    ids = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(ids).logits
        hf_err = (hf.to(dtype)(ids).logits.float() - ref).abs().max().item()
    hf.float()
    model = ours(hf, dtype=dtype)
    out = model(ids, torch.arange(40), FullKVCache(model.cfg, 48, dtype=dtype))
    assert out.dtype == torch.float32  # logits always fp32
    our_err = (out - ref).abs().max().item()
    assert 0 < our_err <= 2 * hf_err + 1e-3, (our_err, hf_err)


def test_unsupported_architecture_lists_supported():
    from transformers import GPT2Config

    with pytest.raises(UnsupportedModelError, match="llama, mistral, qwen2"):
        ModelConfig.from_hf(GPT2Config())


def test_sliding_window_shorter_than_request_is_refused():
    cfg = ModelConfig.from_hf(hf_model(family="mistral", sliding_window=64).config)
    cfg.check_length(64)
    with pytest.raises(ValueError, match="sliding_window=64"):
        cfg.check_length(65)


@pytest.mark.slow
def test_compiled_blocks_give_the_same_greedy_tokens():
    """torch.compile of the norms and MLP (inductor; about 2 minutes of compilation on this CPU)."""
    from tiny import pair
    from triforce.engine import Engine, SpeculationConfig
    from triforce.speculation.sampling import SamplingParams

    target, draft = pair(seed=0)
    engine = Engine(target, draft)
    greedy = SamplingParams(temperature=0)
    prompt = list(range(3, 40))
    ref = engine.generate(prompt, max_new_tokens=16, sampling=greedy)[0]
    with pytest.raises(ValueError, match="compile mode"):
        target.compile_blocks("fast")
    target.compile_blocks("default")
    spec = SpeculationConfig(mode="retrieval", budget=16, chunk_size=4, gamma2=3)
    assert engine.generate(prompt, max_new_tokens=16, sampling=greedy, spec=spec)[0] == ref


def test_compile_mode_is_checked():
    from tiny import pair

    target, _ = pair(seed=0)
    with pytest.raises(ValueError, match="compile mode must be one of default, reduce-overhead, max-autotune"):
        target.compile_blocks("fast")


def test_packed_weights_match_transformers():
    """oneDNN-prepacked projections (multi-row products on CPU) keep our logits equal to transformers'."""
    hf = hf_model(0, layers=2)
    model = ours(hf)
    ids = torch.randint(3, 96, (1, 20), generator=torch.Generator().manual_seed(0))
    if not model.pack_weights():
        pytest.skip("oneDNN linear kernels unavailable in this torch build")
    assert model.layers[0].mlp.gate_up_proj.packed is not None
    with torch.no_grad():
        ref = hf(ids).logits
    out = model(ids, torch.arange(20), FullKVCache(model.cfg, 32))  # 20 rows: the packed path
    assert (out - ref).abs().max() < 1e-4
    cache = FullKVCache(model.cfg, 32)  # one row at a time: the (in, out) path, same logits
    rows = torch.cat([model(ids[:, i:i + 1], torch.tensor([i]), cache) for i in range(20)], dim=1)
    assert (rows - ref).abs().max() < 1e-4


def test_reduce_overhead_compile_clones_each_output(monkeypatch):
    """CUDA graphs reuse a graph's output memory at its next replay: with reduce-overhead every compiled call's
    output is a fresh copy (the other modes return the compiled function itself)."""
    from triforce.model.transformer import compile_forward

    buffer = torch.zeros(3)

    def fake_compile(fn, **kw):  # a graph that writes each result into the same memory
        def replay(x):
            return buffer.copy_(fn(x))
        return replay
    monkeypatch.setattr(torch, "compile", fake_compile)
    f = compile_forward(lambda x: x * 2, "reduce-overhead")
    a, b = f(torch.ones(3)), f(torch.full((3,), 5.0))
    assert torch.equal(a, torch.full((3,), 2.0)) and torch.equal(b, torch.full((3,), 10.0))
    assert compile_forward(lambda x: x, "default").__name__ == "replay"
