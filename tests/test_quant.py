"""Cheaper tiers below the verifier: int8 / bf16 weight copies and low-precision caches, exact outputs."""

import pytest
import torch

from tiny import pair
from triforce.caches import FullKVCache
from triforce.engine import Engine, SpeculationConfig
from triforce.model import Linear
from triforce.quant import BF16Linear, Int8Linear, lower_precision_copy
from triforce.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0)


def _linear(k=64, n=48, seed=0):
    torch.manual_seed(seed)
    lin = Linear(k, n, bias=True)
    torch.nn.init.normal_(lin.weight_t, std=0.5)
    torch.nn.init.normal_(lin.bias, std=0.1)
    return lin


def test_int8_linear_error_within_quantization_bound(monkeypatch):
    lin = _linear()
    q = Int8Linear(lin)
    x = torch.randn(5, 64)
    ref = lin(x)
    w = lin.weight_t.detach().T  # (out, in)
    scale = w.abs().amax(1) / 127
    # |x (W - scale q)^T| <= sum_i |x_i| * scale_o / 2, plus bf16 rounding of x and of the output (2^-8 relative)
    bound = x.abs().sum(1, keepdim=True) * scale[None] / 2 + (x.abs() @ w.abs().T) * 2 ** -7 + ref.abs() * 2 ** -7
    assert torch.all((q(x) - ref).abs() <= bound + 1e-6)
    assert (q(x) - ref).abs().max() > 0  # it really is quantized
    ours = q(x)  # our kernel where the CPU has AVX-512, else PyTorch's op
    monkeypatch.setattr("triforce.quant.int8_linear", lambda *a: None)  # PyTorch's op (bf16 activations)
    assert torch.all((q(x) - ref).abs() <= bound + 1e-6)
    assert torch.allclose(q(x), ours, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
    slow = Int8Linear(lin)
    slow.fast = False  # the dequantizing fallback computes the same product
    assert torch.allclose(slow(x), q(x), rtol=2e-2, atol=2e-2 * ref.abs().max().item())
    assert q.q.dtype == torch.int8 and q.q.shape == (48, 64)


def test_bf16_linear_close():
    lin = _linear(seed=1)
    x = torch.randn(3, 64)
    assert torch.allclose(BF16Linear(lin)(x), lin(x), rtol=3e-2, atol=3e-2 * lin(x).abs().max().item())


@pytest.mark.parametrize("weights", ["int8", "bfloat16"])
def test_copy_leaves_the_source_model_unchanged(weights):
    target, _ = pair(seed=4)
    ids = torch.tensor([[5, 9, 13, 40, 2, 7]])
    pos = torch.arange(6)

    def logits(model):
        cache = FullKVCache(model.cfg, 8, model.dtype)
        return model(ids, pos, cache)

    before = logits(target)
    low = lower_precision_copy(target, weights)
    after = logits(target)
    assert torch.equal(before, after)
    approx = logits(low)
    assert not torch.equal(approx, before)
    cos = torch.nn.functional.cosine_similarity(approx.flatten(), before.flatten(), dim=0)
    assert cos > 0.98
    assert isinstance(target.lm_head, Linear)  # the source keeps its fp32 layers


@pytest.mark.parametrize("weights,kv", [("int8", None), ("bfloat16", "bfloat16"), (None, "float16"), ("int8", "bfloat16")])
def test_cheaper_lower_tiers_are_lossless_greedy(weights, kv):
    target, draft = pair(seed=5)
    engine = Engine(target, draft)
    g = torch.Generator().manual_seed(9)
    for _ in range(4):
        prompt = torch.randint(3, 96, (int(torch.randint(10, 70, (1,), generator=g)),), generator=g).tolist()
        ref, _ = engine.generate(prompt, max_new_tokens=24, sampling=GREEDY)
        for mode in ("retrieval", "draft", "triforce"):
            spec = SpeculationConfig(mode=mode, budget=24, chunk_size=4, gamma1=3, gamma2=4, draft_sink=4,
                                     draft_window=12, lower_weights=weights, lower_kv_dtype=kv)
            out, stats = engine.generate(prompt, max_new_tokens=24, sampling=GREEDY, spec=spec)
            assert out == ref, (mode, weights, kv)


def test_kv_dtype_bf16_verifier_is_its_own_reference():
    """With bf16 caches the verifier is a different (bf16-cache) model; speculation reproduces it exactly."""
    target, draft = pair(seed=6)
    engine = Engine(target, draft, kv_dtype="bfloat16")
    prompt = list(range(3, 50))
    ref, _ = engine.generate(prompt, max_new_tokens=20, sampling=GREEDY)
    assert engine.full_cache.k.dtype == torch.bfloat16
    for mode in ("retrieval", "triforce"):
        spec = SpeculationConfig(mode=mode, budget=24, chunk_size=4, gamma1=2, gamma2=4, draft_sink=4, draft_window=12)
        assert engine.generate(prompt, max_new_tokens=20, sampling=GREEDY, spec=spec)[0] == ref


def test_bad_dtype_options_are_named():
    target, _ = pair(seed=0)
    with pytest.raises(ValueError, match="kv_dtype"):
        Engine(target, kv_dtype="int4")
    with pytest.raises(ValueError, match="lower_weights"):
        SpeculationConfig(lower_weights="int2")
    with pytest.raises(ValueError, match="lower_kv_dtype"):
        SpeculationConfig(lower_kv_dtype="int8")
    with pytest.raises(ValueError, match="lower_weights"):
        lower_precision_copy(target, "fp8")
