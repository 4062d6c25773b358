"""Cheaper tiers below the verifier: int8 / bf16 weight copies and low-precision caches, exact outputs."""

import pytest
import torch

from tiny import hf_model, ours, pair
from triforce.engine import Engine, SpeculationConfig
from triforce.kernels import decode_step
from triforce.kv.caches import FullKVCache
from triforce.kv.retrieval import RetrievalCache
from triforce.model.quant import BF16Linear, Int8Linear, lower_precision_copy
from triforce.model.transformer import Linear
from triforce.speculation.sampling import SamplingParams

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
    monkeypatch.setattr("triforce.model.quant.int8_linear", lambda *a: None)  # PyTorch's op (bf16 activations)
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


@pytest.mark.parametrize("weights,kv", [("int8", None), ("bfloat16", "bfloat16"), (None, "float16"),
                                       ("int8", "bfloat16")])
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


def _int8_step(low, ret, token, n):
    """One decode step of ``low`` over ``ret`` at position n: logits (1, 1, V), then the cache back at n."""
    logits = low(torch.tensor([[token]]), torch.tensor([n]), ret, num_logits=1)
    k, v = ret.k.clone(), ret.v.clone()
    ret.rollback(n)
    return logits, k, v


@pytest.mark.parametrize("family,heads,kv_heads", [("llama", 4, 2), ("qwen2", 4, 1), ("llama", 8, 8)])
def test_int8_decode_step_in_one_call_is_the_python_layers(family, heads, kv_heads, monkeypatch):
    """csrc/decode_step.c runs an int8 copy's decode step over a retrieval cache as Block.forward does layer by layer
    (qwen2: projections with bias; GQA groups of 2 and 4, and none), and a block of 3 tokens over it: the same logits
    and the same keys and values written, to float rounding (only SiLU's exp is PyTorch's on one side, Cephes' on
    the other)."""
    if decode_step.decode_step_status().split(" ")[0] != "on":
        pytest.skip(f"decode step kernel {decode_step.decode_step_status()}")
    hf = hf_model(8, vocab=96, layers=3, family=family, heads=heads, kv_heads=kv_heads)
    with torch.no_grad():  # transformers initialises biases to 0: give them values the kernel must add
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    target = ours(hf)
    low = lower_precision_copy(target, "int8")
    assert low.decode_step is not None
    n, g = 40, torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 96, (n,), generator=g)
    full = FullKVCache(target.cfg, 64, record_queries=True)
    target(prompt[None], torch.arange(n), full)
    ret = RetrievalCache(target.cfg, full, 16, 4)
    ret.build_from_full(n - 1)
    low(prompt[None, -1:], torch.tensor([n - 1]), ret)  # a generated slot too
    calls = []
    step = low.decode_step
    monkeypatch.setattr(low, "decode_step", lambda *a: calls.append(step(*a)) or calls[-1])
    for token in (7, 50):
        fused = _int8_step(low, ret, token, n)
        assert calls[-1] is not None  # the one-call step ran
        monkeypatch.setattr(low, "decode_step", None)
        python = _int8_step(low, ret, token, n)
        monkeypatch.setattr(low, "decode_step", lambda *a: calls.append(step(*a)) or calls[-1])
        for a, b in zip(fused, python):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())
        assert fused[0].argmax() == python[0].argmax()
        assert not torch.equal(fused[1], ret.k)  # this step's keys were written (and rolled back after)
    # a block over the retrieval cache (the tier verifying an n-gram drafter's tokens, or catching up with a
    # verification) runs in one call too, its tokens written below the block's first slot
    calls.clear()
    ids, pos = torch.tensor([[7, 8, 9]]), torch.tensor([n, n + 1, n + 2])
    fused = (low(ids, pos, ret), ret.k.clone(), ret.v.clone())
    ret.rollback(n)
    assert len(calls) == 1 and calls[0] is not None
    monkeypatch.setattr(low, "decode_step", None)
    python = (low(ids, pos, ret), ret.k.clone(), ret.v.clone())
    ret.rollback(n)
    for a, b in zip(fused, python):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())
    assert torch.equal(fused[0].argmax(-1), python[0].argmax(-1))


def test_int8_decode_step_declines_what_it_does_not_take():
    """Head sizes the attention kernel does not take (not a multiple of 8), other dtypes, fp16 caches and caches whose
    keys and values differ in dtype: None, so the model runs its layers in Python."""
    target = ours(hf_model(9, vocab=96, layers=3, hidden=48, heads=4, kv_heads=2))  # head_dim 12
    low = lower_precision_copy(target, "int8")
    full = FullKVCache(target.cfg, 64)
    ret = RetrievalCache(target.cfg, full, 16, 4)
    x = torch.zeros(1, 1, 48)
    cos = sin = torch.zeros(1, 12)
    assert low.decode_step is None or decode_step.decode_layers(low.decode_step.table, x, ret.k, ret.v, 0, 16, cos,
                                                                 sin) is None
    target, _ = pair(seed=9)
    low = lower_precision_copy(target, "int8")
    table = low.decode_step.table
    x, cos = torch.zeros(1, 1, 64), torch.zeros(1, 16)
    k = torch.zeros(3, 1, 2, 16, 16)
    assert decode_step.decode_layers(table, x, k.half(), k.half(), 0, 16, cos, cos) is None  # fp16 caches: Python's
    assert decode_step.decode_layers(table, x, k.bfloat16(), k, 0, 16, cos, cos) is None  # keys and values differ
    assert decode_step.decode_layers(table, x.double(), k, k, 0, 16, cos, cos) is None
    assert decode_step.decode_layers(table, x, k, k, 16, 16, cos, cos) is None  # slot outside the rows
    assert lower_precision_copy(target, "bfloat16").decode_step is None
    with pytest.raises(ValueError, match="norms"):
        decode_step.LayerTable(table._keep[0][:1], list(zip(table._keep[1], table._keep[2])), table._keep[4],
                               table.dims, table.eps)


def test_int8_retrieval_tier_in_one_call_is_lossless_greedy(monkeypatch):
    """The retrieval tier's int8 steps in one kernel call: the tokens of autoregressive decoding."""
    target, draft = pair(seed=5)
    engine = Engine(target, draft)
    steps = []
    real = decode_step.decode_layers
    monkeypatch.setattr("triforce.kernels.decode_step.decode_layers", lambda *a: steps.append(real(*a)) or steps[-1])
    g = torch.Generator().manual_seed(11)
    for _ in range(3):
        prompt = torch.randint(3, 96, (int(torch.randint(40, 90, (1,), generator=g)),), generator=g).tolist()
        ref, _ = engine.generate(prompt, max_new_tokens=24, sampling=GREEDY)
        spec = SpeculationConfig(mode="retrieval", budget=24, chunk_size=4, gamma2=4, lower_weights="int8")
        assert engine.generate(prompt, max_new_tokens=24, sampling=GREEDY, spec=spec)[0] == ref
    if decode_step.decode_step_status().startswith("on"):
        assert steps and all(s is not None for s in steps)


@pytest.mark.parametrize("weights", ["int8", "int4", "bfloat16", "codes"])
def test_a_verifier_quantized_itself_gets_lower_copies(weights):
    """``quantize="int8"`` makes the verifier an int8 copy; the tiers below it then copy its int8 weights (int8:
    the same tensors; int4 / bf16 from their dequantized values; tied embeddings keep the source's matrix): the
    retrieval tier runs, greedy output equals the int8 verifier's plain decoding."""
    target, _ = pair(seed=8)
    verifier = lower_precision_copy(target, "int8")
    low = lower_precision_copy(verifier, weights)
    if weights in ("int8", "codes"):
        assert low.layers[0].mlp.down_proj is verifier.layers[0].mlp.down_proj
    engine = Engine(verifier)
    prompt = list(range(3, 60))
    ref, _ = engine.generate(prompt, max_new_tokens=16, sampling=GREEDY)
    spec = SpeculationConfig(mode="retrieval", budget=24, chunk_size=4, gamma2=4, lower_weights=weights)
    assert engine.generate(prompt, max_new_tokens=16, sampling=GREEDY, spec=spec)[0] == ref


@pytest.mark.parametrize("weights", ["int8", "bfloat16"])
def test_lower_precision_copy_of_a_compiled_model_runs_its_own_mlp(monkeypatch, weights):
    """compile_blocks stores a compiled forward bound to each full-precision MLP; the lower-precision copy used to
    carry it along, so its MLPs ran the source's weights. torch.compile is replaced by a pass-through that keeps the
    bound method (what the real one does, without minutes of inductor compilation)."""
    from triforce.kv.caches import FullKVCache
    from triforce.model.quant import lower_precision_copy

    compiled = []

    def fake_compile(fn, **kw):
        compiled.append((getattr(fn, "__self__", None), kw))
        return fn

    target, _ = pair(seed=0)
    plain = lower_precision_copy(target, weights)  # from the uncompiled model: the reference
    monkeypatch.setattr(torch, "compile", fake_compile)
    target.compile_blocks("max-autotune")
    lower = lower_precision_copy(target, weights)
    for block, source in zip(lower.layers, target.layers):
        assert block.mlp is not source.mlp and block.mlp.forward.__self__ is block.mlp
        assert (block.mlp, dict(mode="max-autotune", dynamic=False)) in compiled  # the copy's MLP compiled, same mode

    def logits(model):
        ids = torch.tensor([list(range(3, 30))])
        return model(ids, torch.arange(27), FullKVCache(model.cfg, 32))

    ref, full = logits(plain), logits(target)
    assert torch.equal(logits(lower), ref)
    assert not torch.allclose(ref, full, atol=1e-4)  # the check can tell the two precisions apart
