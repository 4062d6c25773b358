"""csrc/attention.c (``kernels.gqa_attention_kernel``) against PyTorch's SDPA with the full KV cache's causal mask;
csrc/qlinear.c (``kernels.int8_linear``) against the fp64 product of the dequantized weights."""

import math

import pytest
import torch

from conftest import use_avx2_build, use_portable_build
from tiny import hf_config
from triforce.kernels import cpu as kernels
from triforce.kernels import sdpa
from triforce.kernels.sdpa import gqa_attention
from triforce.kv.caches import FullKVCache, _causal_offset_mask
from triforce.model.config import ModelConfig

pytestmark = pytest.mark.skipif(kernels.status().startswith("unavailable"), reason=f"kernel {kernels.status()}")


@pytest.fixture(params=["native", "portable"])
def attention_build(request, monkeypatch):
    """The attention kernel as this CPU's build, and its portable build (plain C: a CPU without AVX2, or aarch64)."""
    if request.param == "portable":
        use_portable_build(monkeypatch, kernels, "_attention", kernels.status(), kernels.attention_build)
    return request.param


@pytest.mark.parametrize("b,nh,nkv,t,hs,n_keys,cap", [
    (1, 9, 3, 1, 64, 8000, 8010),    # SmolLM2 decode at 8K: many chunks, a partial last one
    (1, 9, 3, 7, 64, 1000, 1000),    # a verification block of 7
    (2, 12, 2, 3, 128, 300, 320),    # Qwen2.5 shape, batch 2
    (1, 4, 4, 1, 8, 5, 9),           # MHA, fewer keys than a chunk
    (1, 32, 8, 5, 16, 513, 600),     # Llama-3 grouping, chunk boundary + 1
    (1, 6, 1, 2, 24, 257, 257),      # MQA, head_dim not a power of two
    (1, 10, 2, 4, 72, 700, 700),     # 20 rows per KV head (3-row passes and a 2-row one), 9 value vectors (4+4+1)
])
def test_kernel_matches_sdpa(b, nh, nkv, t, hs, n_keys, cap, attention_build):
    g = torch.Generator().manual_seed(n_keys)
    q = torch.randn(b, nh, t, hs, generator=g)
    k = torch.randn(b, nkv, cap, hs, generator=g) * 3  # spread the scores: softmax far from uniform
    v = torch.randn(b, nkv, cap, hs, generator=g)
    mask = _causal_offset_mask(n_keys - t, t, n_keys, q.device)
    exact = gqa_attention(q.double(), k[:, :, :n_keys].double(), v[:, :, :n_keys].double(), mask)  # fp64 reference
    sdpa = gqa_attention(q, k[:, :, :n_keys], v[:, :, :n_keys], None if t == 1 else mask)
    out = kernels.gqa_attention_kernel(q, k, v, n_keys)
    assert out is not None and out.shape == sdpa.shape and out.dtype == torch.float32
    # fp32 rounding only: within 2x SDPA's own error against fp64 (and at most 1e-5 absolute)
    err, err_sdpa = (out.double() - exact).abs().max().item(), (sdpa.double() - exact).abs().max().item()
    assert err <= max(2 * err_sdpa, 1e-6) and err < 1e-5, (err, err_sdpa)


@pytest.mark.parametrize("t,split", [(1, 300), (1, 1), (3, 257)])
def test_kernel_log_sum_exp_merges_two_key_ranges(t, split, attention_build):
    """lse is log sum_j exp(q.k_j / sqrt(hs)) per query (fp64 reference); attention over keys [0, n) equals the merge
    (merge_attention) of the kernel over [0, split) and over [split, n) (a view of the cache, its own n_keys), within
    fp32 rounding: the retrieval cache's path for a prompt shorter than its budget."""
    g = torch.Generator().manual_seed(split)
    b, nh, nkv, hs, n = 1, 9, 3, 64, 700
    q = torch.randn(b, nh, t, hs, generator=g)
    k, v = torch.randn(b, nkv, n, hs, generator=g) * 2, torch.randn(b, nkv, n, hs, generator=g)
    lse = torch.empty(b, nh, t)
    out = kernels.gqa_attention_kernel(q, k, v, n, lse)
    kk = k.repeat_interleave(nh // nkv, 1).double()
    s = q.double() @ kk.transpose(-1, -2) / math.sqrt(hs)  # (B, nh, T, n)
    s = s.masked_fill(~_causal_offset_mask(n - t, t, n, q.device), float("-inf"))
    torch.testing.assert_close(lse.double(), torch.logsumexp(s, -1), rtol=1e-6, atol=1e-5)
    if t == 1:  # a single query: the two ranges are independent key sets
        l1, l2 = torch.empty(b, nh, 1), torch.empty(b, nh, 1)
        first = kernels.gqa_attention_kernel(q, k, v, split, l1)
        second = kernels.gqa_attention_kernel(q, k[:, :, split:], v[:, :, split:], n - split, l2)
        torch.testing.assert_close(kernels.merge_attention(first, l1, second, l2), out, rtol=1e-5, atol=1e-6)
    assert kernels.gqa_attention_kernel(q, k, v, n, torch.empty(b, nh, t + 1)) is None  # lse of the wrong shape


@pytest.mark.parametrize("b,nh,nkv,t,hs,n_keys,cap", [
    (1, 9, 3, 1, 64, 1000, 1000),    # SmolLM2's retrieval step over a 1,000-slot cache (the AVX-512 path)
    (1, 9, 3, 5, 64, 700, 720),      # a retrieval pass of 5 tokens
    (2, 12, 2, 3, 128, 300, 320),    # Qwen2.5 shape, batch 2
    (1, 6, 1, 2, 24, 257, 257),      # head_dim 24: the AVX2 path
    (1, 10, 2, 4, 40, 700, 700),     # the AVX2 path, 20 rows per KV head, 5 value vectors
])
def test_kernel_over_a_bf16_cache_is_the_kernel_over_its_fp32_values(b, nh, nkv, t, hs, n_keys, cap,
                                                                     attention_build):
    """A bf16 cache (a lower tier's ``lower_kv_dtype``): each element widened exactly, so the output and the
    log-sum-exp are bitwise the kernel's over the fp32 copy of the same cache, and agree with SDPA over it."""
    g = torch.Generator().manual_seed(n_keys + t)
    q = torch.randn(b, nh, t, hs, generator=g)
    k = (torch.randn(b, nkv, cap, hs, generator=g) * 3).to(torch.bfloat16)
    v = torch.randn(b, nkv, cap, hs, generator=g).to(torch.bfloat16)
    lse16, lse32 = torch.empty(b, nh, t), torch.empty(b, nh, t)
    out16 = kernels.gqa_attention_kernel(q, k, v, n_keys, lse16)
    out32 = kernels.gqa_attention_kernel(q, k.float(), v.float(), n_keys, lse32)
    assert out16 is not None and out16.dtype == torch.float32
    assert torch.equal(out16, out32) and torch.equal(lse16, lse32)
    mask = _causal_offset_mask(n_keys - t, t, n_keys, q.device)
    exact = gqa_attention(q.double(), k[:, :, :n_keys].double(), v[:, :, :n_keys].double(), mask)
    assert (out16.double() - exact).abs().max().item() < 1e-5
    assert kernels.gqa_attention_kernel(q, k, v.float(), n_keys) is None  # keys and values of different dtypes
    assert kernels.gqa_attention_kernel(q, k.half(), v.half(), n_keys) is None  # fp16: SDPA's


def test_kernel_declines_what_it_does_not_handle():
    q, k = torch.randn(1, 2, 1, 12), torch.randn(1, 2, 10, 12)  # head_dim 12: not a multiple of 8
    assert kernels.gqa_attention_kernel(q, k, k, 10) is None
    q, k = torch.randn(1, 2, 1, 16, dtype=torch.float64), torch.randn(1, 2, 10, 16, dtype=torch.float64)
    assert kernels.gqa_attention_kernel(q, k, k, 10) is None
    q, k = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 10, 16)
    assert kernels.gqa_attention_kernel(q, k, k, 11) is None  # more keys than the cache holds
    k = torch.randn(1, 3, 10, 16)
    assert kernels.gqa_attention_kernel(torch.randn(2, 9, 1, 16), k, k, 10) is None  # batch of q and k differ
    assert kernels.gqa_attention_kernel(torch.randn(1, 10, 1, 16), k, k, 10) is None  # 10 heads over 3 KV heads
    assert kernels.gqa_attention_kernel(torch.randn(1, 9, 1, 16), k, torch.randn(1, 3, 10, 8), 10) is None  # v shape
    assert kernels.gqa_attention_kernel(torch.randn(1, 9, 0, 16), k, k, 10) is None  # an empty block


def test_full_cache_decode_uses_kernel_and_equals_sdpa():
    """Decode steps through FullKVCache with the kernel on and off give the same outputs."""
    tiny_cfg = ModelConfig.from_hf(hf_config(heads=6, kv_heads=2, hidden=96))
    L, nkv = tiny_cfg.num_hidden_layers, tiny_cfg.num_key_value_heads
    hs, nh = tiny_cfg.head_dim, tiny_cfg.num_attention_heads
    outs = []
    for max_block in (1, 0):
        cache = FullKVCache(tiny_cfg, capacity=40)
        cache.kernel_max_block = max_block
        gen = torch.Generator().manual_seed(1)
        for start, t in ((0, 30), (30, 1), (31, 1)):
            cache.begin_forward(torch.arange(start, start + t))
            out = [cache.attend(layer, torch.randn(1, nh, t, hs, generator=gen),
                                torch.randn(1, nkv, t, hs, generator=gen), torch.randn(1, nkv, t, hs, generator=gen),
                                None) for layer in range(L)]
            cache.end_forward()
        outs.append(torch.stack(out))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("nh,nkv,hs,t", [(9, 3, 64, 7), (32, 2, 64, 9),  # 21 rows per KV head; 144 (over 128)
                                         (10, 2, 40, 5)])  # 25 rows: 3-row value passes and a 1-row one; 4+1 vectors
def test_row_does_not_depend_on_block(nh, nkv, hs, t, attention_build):
    """A query's output is bitwise the same whether it is attended alone (decode) or in a block (verification),
    also when the block has more rows per KV head than a decode step has (the chunks do not depend on the rows)."""
    g = torch.Generator().manual_seed(3)
    n = 1500
    k, v = torch.randn(1, nkv, n, hs, generator=g), torch.randn(1, nkv, n, hs, generator=g)
    q = torch.randn(1, nh, t, hs, generator=g)
    block = kernels.gqa_attention_kernel(q, k, v, n)
    for i in range(t):  # token i of the block sees keys [0, n - t + i]
        alone = kernels.gqa_attention_kernel(q[:, :, i:i + 1], k, v, n - t + 1 + i)
        assert torch.equal(block[:, :, i:i + 1], alone)
    threads = torch.get_num_threads()
    try:  # the threads split the chunks (and prefetch each other's next ones): the result may not depend on it
        for n_threads in (2, 3):
            torch.set_num_threads(n_threads)
            assert torch.equal(kernels.gqa_attention_kernel(q, k, v, n), block), n_threads
    finally:
        torch.set_num_threads(threads)


linear_kernels = pytest.mark.skipif(kernels.linear_status().startswith("unavailable"),
                                 reason=f"linear kernels {kernels.linear_status()}")


@pytest.fixture(params=["native", "avx2", "portable"])
def linear_build(request, monkeypatch):
    """The linear kernels as this CPU's build (AVX-512 or AVX2), the AVX2 build too where the native one is AVX-512,
    and the portable build (plain C), so every branch of csrc/qlinear.c this CPU runs is checked."""
    if request.param == "avx2":
        use_avx2_build(monkeypatch, kernels, "_linear", kernels.linear_status(), kernels.linear_build)
    if request.param == "portable":
        use_portable_build(monkeypatch, kernels, "_linear", kernels.linear_status(), kernels.linear_build)
    return request.param


@linear_kernels
@pytest.mark.parametrize("out,n_in", [(960, 576), (3072, 576), (576, 1536), (37, 23), (5, 16), (130, 48)])
def test_int8_kernel_matches_fp64_and_rows_are_independent(out, n_in, linear_build):
    """Every row count up to INT8_LINEAR_MAX_ROWS: within fp32 rounding of the exact product, and each row bit-identical
    to the same row computed alone (a decode step equals its row in a verification block)."""
    g = torch.Generator().manual_seed(out)
    q = torch.randint(-127, 128, (out, n_in), dtype=torch.int8, generator=g)
    scale = torch.rand(out, generator=g) * 0.02
    x = torch.randn(kernels.INT8_LINEAR_MAX_ROWS, n_in, generator=g)
    exact = x.double() @ (q.double() * scale.double()[:, None]).T  # (M, out)
    alone = torch.cat([kernels.int8_linear(x[i:i + 1], q, scale) for i in range(len(x))])
    bound = (x.double().abs() @ (q.double().abs() * scale.double()[:, None]).T) * n_in * 2 ** -24 + 1e-30  # per row
    for m in (1, 2, 3, 4, 5, 7, 8, kernels.INT8_LINEAR_MAX_ROWS):
        y = kernels.int8_linear(x[:m], q, scale)
        assert y is not None and y.shape == (m, out) and y.dtype == torch.float32
        assert torch.all((y.double() - exact[:m]).abs() <= bound[:m])
        assert torch.equal(y, alone[:m])


@linear_kernels
def test_int8_kernel_declines_what_it_does_not_handle():
    q, s = torch.zeros(8, 32, dtype=torch.int8), torch.ones(8)
    # too many rows: PyTorch's op
    assert kernels.int8_linear(torch.randn(kernels.INT8_LINEAR_MAX_ROWS + 1, 32), q, s) is None
    assert kernels.int8_linear(torch.randn(1, 32, dtype=torch.bfloat16), q, s) is None  # bf16 activations
    assert kernels.int8_linear(torch.randn(1, 31), q, s) is None  # in differs
    assert kernels.int8_linear(torch.randn(1, 32), q, torch.ones(7)) is None  # one scale per output
    assert kernels.int8_linear(torch.randn(1, 32), q.T.contiguous().T, s) is None  # not contiguous
    assert kernels.int8_linear(torch.randn(0, 32), q, s) is None  # no rows


@linear_kernels
@pytest.mark.parametrize("n_in,out", [(576, 960), (1536, 576), (576, 192), (64, 48), (23, 16), (576, 49152 // 8),
                                      (64, 97), (576, 32001 // 8), (40, 7)])  # widths with tail columns (issue 47)
def test_f32_kernel_matches_fp64_and_rows_are_independent(n_in, out, linear_build):
    """The fp32 product with (in, out) weights for every row count up to LINEAR_MAX_ROWS, and 70 and 130 (the
    verifier's batches, issue 47) (one pass, several passes over a tile, the narrow blocks of a small matrix): within
    the error bound of fp32 summation (n * 2^-24 of sum |x w|) of the exact product, and each row bit-identical to
    the same row computed alone."""
    g = torch.Generator().manual_seed(out)
    w = torch.randn(n_in, out, generator=g)
    x = torch.randn(130, n_in, generator=g)
    exact = x.double() @ w.double()
    alone = torch.cat([kernels.f32_linear(x[i:i + 1], w) for i in range(len(x))])
    bound = (x.double().abs() @ w.double().abs()) * n_in * 2 ** -24  # per row
    for m in [*range(1, kernels.LINEAR_MAX_ROWS + 1), 70, 130]:
        y = kernels.f32_linear(x[:m], w)
        assert y is not None and y.shape == (m, out) and y.dtype == torch.float32
        assert torch.all((y.double() - exact[:m]).abs() <= bound[:m])
        assert torch.equal(y, alone[:m])


@linear_kernels
def test_f32_kernel_declines_what_it_does_not_handle():
    w = torch.randn(32, 48)
    assert kernels.f32_linear(torch.randn(kernels.F32_MAX_ROWS + 1, 32), w) is None  # too many rows for one call
    assert kernels.f32_linear(torch.randn(0, 32), w) is None  # no rows
    assert kernels.f32_linear(torch.randn(2, 31), w) is None  # in differs
    assert kernels.f32_linear(torch.randn(2, 32), torch.randn(48, 32).T) is None  # not contiguous
    assert kernels.f32_linear(torch.randn(2, 32, dtype=torch.bfloat16), w.bfloat16()) is None  # bf16
    assert kernels.f32_linear(torch.randn(2, 32, dtype=torch.float64), w.double()) is None  # fp64


@linear_kernels
def test_linear_runs_the_kernel_for_a_few_rows_only():
    """model.Linear: 2..LINEAR_MAX_ROWS rows through the kernel (with the bias added), one row and prefill through
    PyTorch's product; all within fp32 rounding of each other."""
    from triforce.model.transformer import Linear

    lin = Linear(64, 96, bias=True)
    torch.nn.init.normal_(lin.weight_t)
    torch.nn.init.normal_(lin.bias)
    x = torch.randn(1, kernels.LINEAR_MAX_ROWS + 40, 64)
    with torch.no_grad():
        ref = x @ lin.weight_t + lin.bias
        for t in (1, 2, 7, 28, kernels.LINEAR_MAX_ROWS, kernels.LINEAR_MAX_ROWS + 1, kernels.LINEAR_MAX_ROWS + 40):
            y = lin(x[:, :t])
            torch.testing.assert_close(y, ref[:, :t], rtol=1e-5, atol=1e-4)
            if 1 < t <= kernels.LINEAR_MAX_ROWS or (t == 1 and kernels.f32_one_row_pays()):
                assert torch.equal(y[0], kernels.f32_linear(x[0, :t], lin.weight_t) + lin.bias)
        if kernels.f32_one_row_pays():  # a decode step's row is bitwise its row in a block
            assert torch.equal(lin(x[:, :1])[0, 0], lin(x[:, :7])[0, 0])


@linear_kernels
@pytest.mark.parametrize("value", ["1", "0", ""])
def test_one_row_switch_chooses_the_decode_steps_product(value, monkeypatch):
    """TRIFORCE_ONE_ROW_KERNEL: "1" puts a decode step's products on our kernel whatever the build (its row then equals
    its row in a 7-row block bitwise), "0" on MKL's GEMV, unset the build's default (AVX-512 only); another value is a
    ValueError naming the variable and the allowed values."""
    from triforce.model.transformer import Linear

    status = kernels.linear_status()
    fresh = kernels.linear_build("AVX-512" if "AVX-512" in status else "AVX2" if "AVX2" in status else "portable")
    monkeypatch.setattr(kernels, "_linear", fresh)
    monkeypatch.setenv(kernels.ONE_ROW_ENV_SWITCH, value)
    expected = {"1": True, "0": False, "": "AVX-512" in kernels.linear_status()}[value]
    assert kernels.f32_one_row_pays() is expected
    lin = Linear(64, 96)
    torch.nn.init.normal_(lin.weight_t)
    x = torch.randn(1, 7, 64)
    with torch.no_grad():
        one = lin(x[:, :1])[0, 0]
        if expected:
            assert torch.equal(one, kernels.f32_linear(x[0, :1], lin.weight_t)[0])
            assert torch.equal(one, lin(x)[0, 0])
        else:
            assert torch.equal(one, (x[0, :1] @ lin.weight_t)[0])  # MKL's GEMV, as before the kernels


@linear_kernels
@pytest.mark.parametrize("beats", [True, False])
def test_packed_weights_take_blocks_where_onednn_is_faster(beats, monkeypatch):
    """With packed weights, a block of 2..64 rows runs on our kernel where it beats oneDNN (AVX-512 build) and on
    oneDNN's packed product where it does not (AVX2 build): bitwise the one or the other, both within fp32 rounding of
    the plain product; packing_pays packs exactly where oneDNN wins."""
    from triforce.model.transformer import Linear

    monkeypatch.setattr(kernels._linear, "beats_onednn", beats)
    lin = Linear(64, 96)
    torch.nn.init.normal_(lin.weight_t)
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN")
    lin.packed = torch.ops.mkldnn._reorder_linear_weight(lin.weight_t.detach().T.contiguous(), None)
    x = torch.randn(1, 7, 64)
    with torch.no_grad():
        y = lin(x)[0]
        ours = kernels.f32_linear(x[0], lin.weight_t)
        onednn = torch.ops.mkldnn._linear_pointwise(x[0], lin.packed, None, "none", [], "")
        assert torch.equal(y, ours if beats else onednn)
        torch.testing.assert_close(y, x[0] @ lin.weight_t, rtol=1e-5, atol=1e-4)
    from tiny import hf_model, ours  # tests/tiny.py

    assert ours(hf_model()).packing_pays() is (not beats)


def test_one_row_switch_rejects_other_values(monkeypatch):
    monkeypatch.setattr(kernels, "_linear", kernels.linear_build("AVX2"))
    monkeypatch.setenv(kernels.ONE_ROW_ENV_SWITCH, "yes")
    with pytest.raises(ValueError, match="TRIFORCE_ONE_ROW_KERNEL must be '0', '1' or unset, got 'yes'"):
        kernels.f32_one_row_pays()


norm_rope_kernels = pytest.mark.skipif(kernels.norm_rope_status().startswith("unavailable"),
                                       reason=f"norm/rope kernels {kernels.norm_rope_status()}")


@norm_rope_kernels
@pytest.mark.parametrize("d", [576, 64, 23])
def test_rms_norm_kernel_matches_the_formula_and_rows_are_independent(d):
    """weight * x / sqrt(mean(x^2) + eps) in fp64, within fp32 rounding; a row's result is bit-identical alone."""
    g = torch.Generator().manual_seed(d)
    x, w = torch.randn(2, 9, d, generator=g) * 3, torch.randn(d, generator=g)
    exact = w.double() * x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5)
    y = kernels.rms_norm(x, w, 1e-5)
    assert y is not None and y.shape == x.shape and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), exact, rtol=4e-6, atol=4e-6 * exact.abs().max().item())
    assert torch.equal(kernels.rms_norm(x[1:2, 4:5], w, 1e-5), y[1:2, 4:5])
    assert kernels.rms_norm(x.double(), w.double(), 1e-5) is None  # fp64: PyTorch's ops
    assert kernels.rms_norm(x, w[:-1], 1e-5) is None  # weight of another size


@norm_rope_kernels
def test_rope_kernel_equals_pytorchs_rotation_bitwise():
    """x * cos + rotate_half(x) * sin on a strided view of a fused projection: the same bits as PyTorch's ops."""
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(2, 7, 9 * 64 + 2 * 3 * 64, generator=g)
    q = qkv[..., :576].view(2, 7, 9, 64).transpose(1, 2)  # (B, nh, T, hs), not contiguous
    cos, sin = torch.randn(7, 64, generator=g), torch.randn(7, 64, generator=g)
    expected = q * cos + torch.cat((-q[..., 32:], q[..., :32]), dim=-1) * sin
    assert torch.equal(kernels.rope(q, cos, sin), expected)
    assert kernels.rope(q, cos[:6], sin[:6]) is None  # positions differ from T
    assert kernels.rope(torch.randn(1, 2, 3, 5), torch.randn(3, 5), torch.randn(3, 5)) is None  # odd head size


@pytest.fixture
def lower_right_on_cpu(monkeypatch):
    """lower_right_attention's code on this CPU in fp32 (it applies to CUDA in half precision only)."""
    monkeypatch.setattr(sdpa, "LOWER_RIGHT_DEVICES", ("cpu",))
    monkeypatch.setattr(sdpa, "LOWER_RIGHT_DTYPES", (torch.float32,))


@pytest.mark.parametrize("start, t", [(0, 5), (30, 7), (10, 2)])
def test_lower_right_bias_equals_the_full_caches_block_mask(lower_right_on_cpu, start, t):
    """SDPA with PyTorch's lower-right causal bias sees what the full cache's boolean block mask lets through."""
    g = torch.Generator().manual_seed(start + t)
    n = start + t
    q = torch.randn(1, 4, t, 16, generator=g)
    k, v = torch.randn(1, 4, n + 3, 16, generator=g), torch.randn(1, 4, n + 3, 16, generator=g)
    out = sdpa.lower_right_attention(q, k, v, n)
    expected = gqa_attention(q, k[:, :, :n], v[:, :, :n], _causal_offset_mask(start, t, n, torch.device("cpu")))
    assert out is not None
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_lower_right_attention_declines_what_it_does_not_handle(lower_right_on_cpu):
    q, k = torch.randn(1, 4, 3, 16), torch.randn(1, 4, 10, 16)
    assert sdpa.lower_right_attention(q[:, :, :1], k, k, 10) is None  # a decode step: no mask to replace
    assert sdpa.lower_right_attention(q, k[:, :2], k[:, :2], 10) is None  # grouped-query heads
    assert sdpa.lower_right_attention(q, k, k, 11) is None  # more keys than the cache holds
    assert sdpa.lower_right_attention(q.double(), k.double(), k.double(), 10) is None  # a dtype it does not take
    assert sdpa.lower_right_attention(q, k, k, 2) is None  # fewer keys than queries


def test_lower_right_attention_applies_to_cuda_half_precision_only():
    q, k = torch.randn(1, 4, 3, 16), torch.randn(1, 4, 10, 16)
    assert sdpa.LOWER_RIGHT_DEVICES == ("cuda",)
    assert sdpa.lower_right_attention(q, k, k, 10) is None  # the CPU: csrc/attention.c or the boolean mask
    assert sdpa.lower_right_attention(q.bfloat16(), k.bfloat16(), k.bfloat16(), 10) is None


def test_speculative_modes_through_the_lower_right_path_equal_autoregressive_greedy(lower_right_on_cpu, monkeypatch):
    """Prefill and verification blocks over the full cache through lower_right_attention (an MHA target; the CPU
    kernel off, so every block of 2+ tokens takes it): each mode's greedy tokens equal autoregressive decoding's
    with the boolean mask."""
    import triforce.kv.caches as caches
    from tiny import hf_model, ours
    from triforce.engine import Engine, SpeculationConfig
    from triforce.kernels.rows import PREFILL_EXACT_TAIL
    from triforce.speculation.sampling import SamplingParams

    target = ours(hf_model(3, vocab=96, layers=3, heads=4, kv_heads=4))
    draft = ours(hf_model(1003, vocab=96, layers=1, hidden=32, heads=2, kv_heads=2))
    greedy, prompt = SamplingParams(temperature=0), (list(range(3, 40)) * 4)[:120]
    calls = []
    lower_right = sdpa.lower_right_attention
    monkeypatch.setattr(caches, "gqa_attention_kernel", lambda *a, **kw: None)
    monkeypatch.setattr(sdpa, "LOWER_RIGHT_DEVICES", ())  # the reference: the boolean mask
    ref = Engine(target, draft).generate(prompt, max_new_tokens=24, sampling=greedy)[0]
    monkeypatch.setattr(sdpa, "LOWER_RIGHT_DEVICES", ("cpu",))
    monkeypatch.setattr(caches, "lower_right_attention", lambda *a: calls.append(a[0].shape[2]) or lower_right(*a))
    for spec in (SpeculationConfig(mode="retrieval", budget=32, chunk_size=4, gamma2=4),
                 SpeculationConfig(mode="triforce", budget=32, chunk_size=4, gamma1=2, gamma2=4, draft_sink=4,
                                   draft_window=16)):
        out = Engine(target, draft).generate(prompt, max_new_tokens=24, sampling=greedy, spec=spec)[0]
        assert out == ref, spec.mode
    # the prefill (its last exact.PREFILL_EXACT_TAIL tokens in a forward of their own) and the gamma2 + 1 = 5-token
    # verification blocks took the path
    assert 120 - PREFILL_EXACT_TAIL in calls and PREFILL_EXACT_TAIL in calls and 5 in calls


def test_decode_steps_silu_equals_pytorchs_and_is_the_same_at_every_width():
    """csrc/decode_step.c's SiLU(g) * u (Cephes' exp, 16 or 8 lanes or scalar by the CPU) against the exact value
    (float64): |got - exact| <= 4 eps |exact| (eps: float32's, 2^-23) over [-90, 90] (a bound on the exp polynomial's
    2e-7 relative
    error plus the division's and products' roundings) for g >= -87; below, where the result leaves float32's normal
    range, at most |g u| 1e-37 (PyTorch's float32 path rounds there too), and exactly 0 past exp's overflow (g < -89,
    down to -FLT_MAX: exp(-g) is inf, as in PyTorch); NaN propagates, g = +inf gives inf u and g = -inf NaN (as
    PyTorch's inf / inf); every width this CPU has (AVX-512, AVX2, scalar) gives the same bits; and an element
    gives the same bits in a vector lane as in the scalar tail (n = 16 + 8 + 3)."""
    from triforce.kernels import decode_step

    lib = decode_step._decode_step.load()
    if lib is None:
        pytest.skip(f"decode step kernel {decode_step.decode_step_status()}")
    silu_mul = lib["triforce_silu_mul"]

    def ours(g, u):
        out = torch.empty_like(g)
        silu_mul(g.data_ptr(), u.data_ptr(), out.data_ptr(), g.numel())
        return out

    gen = torch.Generator().manual_seed(0)
    g = torch.cat([torch.empty(20000).uniform_(-90, 90, generator=gen), torch.randn(20000, generator=gen),
                   torch.tensor([0.0, -0.0, 1e-30, -1e-30, 88.0, -88.0, 100.0, -100.0, 1e4, -1e4])])
    u = torch.empty_like(g).uniform_(-3, 3, generator=gen)
    got, want = ours(g, u), torch.nn.functional.silu(g.double()) * u.double()  # the exact value, to float rounding
    ulp = torch.finfo(torch.float32).eps * want.abs().float().clamp_min(torch.finfo(torch.float32).tiny)
    normal = g >= -87
    assert ((got.double() - want).abs() <= 4 * ulp.double())[normal].all()
    assert (got.abs() <= (g * u).abs() * 1e-37)[~normal].all()
    edge = torch.tensor([float("nan"), float("inf"), 0.5, float("-inf")])
    out = ours(edge, torch.ones(4))
    assert out[0].isnan() and out[1] == float("inf") and out[2] == torch.nn.functional.silu(torch.tensor(0.5))
    assert out[3].isnan()
    huge = -torch.tensor([89.0, 100.0, 1e4, 1e38, torch.finfo(torch.float32).max])
    assert (ours(huge, torch.full((5,), -2.0)) == 0).all()
    by_width = {}
    for isa in (2, 1, 0):  # AVX-512, AVX2, scalar: the same bits (no FMA contraction; IEEE multiplies and adds)
        out = torch.empty_like(g)
        if lib["triforce_silu_mul_isa"](g.data_ptr(), u.data_ptr(), out.data_ptr(), g.numel(), isa) == 0:
            by_width[isa] = out
    assert 0 in by_width and all(torch.equal(out, got) for out in by_width.values())
    # the same inputs in vector lanes (0 .. 23) and in the scalar tail (24 .. 26)
    base = torch.tensor([-87.5, 0.3, 12.25])
    g2 = torch.cat([base.repeat(8), base])
    u2 = torch.empty(27).uniform_(-2, 2, generator=gen)
    u2[24:] = u2[:3]
    out2 = ours(g2, u2)
    assert torch.equal(out2[24:], out2[:3])
