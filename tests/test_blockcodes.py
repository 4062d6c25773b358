"""Exact block codes (blockcodes.py, csrc/blockcodes.c): a GGUF model's fp32 weights as their Q4_1 / Q8_0 codes.

The codes must reproduce every weight exactly, the product must be bitwise our fp32 kernel's over the same weights
(and agree with PyTorch's matmul to fp32 rounding), weights that are not block codes must be refused, and a model
whose verifier reads the codes must keep greedy equality with autoregressive decoding and the exact distribution.
"""

import pytest
import torch

from distribution import NEW, SETTINGS, V, chi2_pvalue, empirical, exact_distribution
from references import gguf_like, q4_1, q8_0, q8_dot_reference
from tiny import hf_model, ours, pair
from triforce.engine import Engine, SpeculationConfig
from triforce.kernels import blockcodes
from triforce.kernels.blockcodes import blockcode_linear, blockcode_linear_q8
from triforce.kernels.codes import find_block_codes
from triforce.kernels.cpu import LINEAR_MAX_ROWS, f32_linear
from triforce.kv.caches import FullKVCache
from triforce.model.transformer import Linear
from triforce.speculation.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not blockcodes.blockcodes_status().startswith("on"),
                                reason=f"block-code kernel: {blockcodes.blockcodes_status()}")


@pytest.mark.parametrize("fmt,bits", [(q4_1, 4), (q8_0, 8)])
@pytest.mark.parametrize("n_in,n_out", [(64, 96), (576, 960), (1536, 576)])
def test_codes_reproduce_every_weight_and_the_fp32_product_bitwise(fmt, bits, n_in, n_out, blockcode_build):
    torch.manual_seed(n_in + n_out + bits)
    w_t = fmt(torch.randn(n_out, n_in) * 0.05).T.contiguous()  # (in, out), as Linear stores it
    codes = find_block_codes(w_t)
    assert codes is not None and codes.bits == bits
    assert torch.equal(codes.dequantize(), w_t)
    assert codes.nbytes == w_t.numel() * (0.625 if bits == 4 else 1.0625)  # codes, fp16 scales (and minima)
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 17, LINEAR_MAX_ROWS):
        x = torch.randn(rows, n_in)
        y = blockcode_linear(x, codes)
        ref = f32_linear(x, w_t)
        if ref is not None:  # our fp32 kernel: the same chain of FMAs, so bitwise equal
            assert torch.equal(y, ref), rows
        torch.testing.assert_close(y, x @ w_t, rtol=1e-5, atol=1e-5)
        assert torch.equal(blockcode_linear(x[:1], codes), y[:1])  # a row alone = the row in a block
    threads = torch.get_num_threads()
    try:  # each thread takes a range of column blocks (uneven for 96 outputs) and prefetches within it
        x = torch.randn(7, n_in)
        y = blockcode_linear(x, codes)
        for n_threads in (2, 3):
            torch.set_num_threads(n_threads)
            assert torch.equal(blockcode_linear(x, codes), y) and torch.equal(blockcode_linear(x[:1], codes), y[:1])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("fmt,bits", [(q4_1, 4), (q8_0, 8)])
@pytest.mark.parametrize("n_in,n_out", [(64, 96), (576, 960), (1536, 576)])
def test_int8_activation_products_compute_their_definition(fmt, bits, n_in, n_out, blockcode_build):
    """blockcode_linear_q8: the definition computed in float64 to fp32 rounding (its integer sums are exact), for
    every row count of a pass (1-4 rows at a time, remainders), a row alone = the row in a block, bitwise the same
    over 1, 2 and 3 threads; within a few percent of the exact product (it is an approximation, for the tiers below
    the verifier only)."""
    torch.manual_seed(n_in + n_out + bits + 1)
    w_t = fmt(torch.randn(n_out, n_in) * 0.05).T.contiguous()
    codes = find_block_codes(w_t)
    for rows in (1, 2, 3, 4, 5, 7, 9, 16, LINEAR_MAX_ROWS):
        x = torch.randn(rows, n_in)
        x[0, :32] = 0  # a block of zeros: scale 0, codes 0
        y = blockcode_linear_q8(x, codes)
        ref = q8_dot_reference(x, codes)
        assert (y.double() - ref).abs().max() <= 1e-5 * ref.abs().max(), rows
        assert torch.equal(blockcode_linear_q8(x[-1:], codes), y[-1:])
        exact = blockcode_linear(x, codes)
        assert (y - exact).norm() <= 0.05 * exact.norm()
    threads = torch.get_num_threads()
    try:
        x = torch.randn(7, n_in)
        y = blockcode_linear_q8(x, codes)
        for n_threads in (1, 2, 3):
            torch.set_num_threads(n_threads)
            assert torch.equal(blockcode_linear_q8(x, codes), y)
    finally:
        torch.set_num_threads(threads)
    assert blockcode_linear_q8(torch.randn(LINEAR_MAX_ROWS + 1, n_in), codes) is None
    assert blockcode_linear_q8(torch.randn(2, n_in + 32), codes) is None


@pytest.mark.parametrize("fmt", [q4_1, q8_0])
def test_every_build_gives_bitwise_the_same_products(fmt, monkeypatch):
    """The AVX2, AVX-512 and AVX-512 VNNI builds of csrc/blockcodes.c (those this CPU runs): the exact products
    bitwise equal (one chain of FMAs per output in each), and the integer dot products too (the same integer sums,
    vpdpbusd or vpmaddubsw + vpmaddwd). Not the portable build: without hardware FMA its chains multiply and add
    (two roundings), so it keeps the rule within itself, bitwise the portable fp32 kernel (``blockcode_build``)."""
    torch.manual_seed(7)
    threads = torch.get_num_threads()
    results = {}
    try:
        # 352 outputs: uneven thread ranges, 8-block spans and a 4-block tail
        for n_in, n_out in ((576, 960), (64, 352)):
            w_t = fmt(torch.randn(n_out, n_in) * 0.05).T.contiguous()
            codes = find_block_codes(w_t)
            x = torch.randn(9, n_in)
            for isa in [name for name in blockcodes._BUILDS if name != "portable"]:
                build = blockcodes.blockcodes_build(isa)
                if build.load() is None:
                    continue
                monkeypatch.setattr(blockcodes, "_blockcodes", build)
                for n_threads in (1, 2, 3):
                    torch.set_num_threads(n_threads)
                    results.setdefault(isa, []).extend(
                        (blockcode_linear(x[:m], codes), blockcode_linear_q8(x[:m], codes)) for m in (1, 2, 4, 7, 9))
    finally:
        torch.set_num_threads(threads)
    if not results:
        pytest.skip("this CPU runs the portable build only")
    first = next(iter(results.values()))
    for isa, outs in results.items():
        assert len(outs) == len(first)
        for (exact, q8), (exact0, q80) in zip(outs, first):
            assert torch.equal(exact, exact0) and torch.equal(q8, q80), isa


@pytest.mark.parametrize("fmt", [q4_1, q8_0])
def test_the_portable_build_with_hardware_fma_is_bitwise_the_avx2_build(fmt, monkeypatch):
    """The portable builds of csrc/qlinear.c and csrc/blockcodes.c where the target fuses fmaf in hardware
    (__FP_FAST_FMAF: aarch64), compiled here with -mfma and without -mavx2 so that their portable branches run: each
    output is the AVX2 build's chain of FMAs, so the fp32 and the exact block-code products are bitwise the AVX2
    build's, and the fit finds the same codes."""
    from triforce.kernels import cpu as kernels
    from triforce.kernels.build import _cpu_flags, _Library

    avx2 = blockcodes.blockcodes_build("AVX2"), kernels.linear_build("AVX2")
    if not {"avx2", "fma", "f16c"} <= _cpu_flags() or any(lib.load() is None for lib in avx2):
        pytest.skip("needs the AVX2 builds (an x86-64 CPU with AVX2, FMA and F16C)")
    flags = kernels.PORTABLE_CFLAGS + ("-fopenmp", "-mfma")
    fused = (_Library("blockcodes.c", "TRIFORCE_BLOCK_CODES", (), lambda: (flags, "portable, FMA"),
                      blockcodes._SYMBOLS),
             _Library("qlinear.c", "TRIFORCE_LINEAR_KERNEL", (), lambda: (flags, "portable, FMA"),
                      kernels._LINEAR_SYMBOLS))
    torch.manual_seed(11)
    w_t = fmt(torch.randn(352, 576) * 0.05).T.contiguous()
    x = torch.randn(9, 576)
    results = []
    for codes_lib, linear_lib in (avx2, fused):
        monkeypatch.setattr(blockcodes, "_blockcodes", codes_lib)
        monkeypatch.setattr(kernels, "_linear", linear_lib)
        codes = find_block_codes(w_t)
        results.append((codes.codes, codes.d, blockcode_linear(x, codes), f32_linear(x, w_t)))
    assert "portable" in fused[0].status and "portable" in fused[1].status
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_int8_activation_products_refuse_q8_0_codes_of_minus_128():
    """vpsignb cannot negate -128: 8-bit codes holding it (which the fit allows, ggml never writes) are refused."""
    w = q8_0(torch.randn(64, 64) * 0.05).T.contiguous()
    codes = find_block_codes(w)
    assert codes.q8_dot_ok and blockcode_linear_q8(torch.randn(1, 64), codes) is not None
    codes.codes[0, 0, 0] = -128
    del codes.q8_dot_ok  # the cached check
    assert not codes.q8_dot_ok and blockcode_linear_q8(torch.randn(1, 64), codes) is None


def test_weights_that_are_not_block_codes_are_refused():
    torch.manual_seed(0)
    w = torch.randn(576, 960) * 0.05
    assert find_block_codes(w) is None  # plain fp32
    assert find_block_codes(w.bfloat16().float()) is None  # a bf16 checkpoint
    exact = q4_1(w.T).T.contiguous()
    assert find_block_codes(exact) is not None
    off_by_one_ulp = exact.clone()
    off_by_one_ulp[300, 700] = torch.nextafter(off_by_one_ulp[300, 700], torch.tensor(1.0))
    assert find_block_codes(off_by_one_ulp) is None  # one weight in a late block: the whole matrix stays fp32
    # d q + m with an fp16 scale but a minimum fp16 cannot hold (Q4_1 stores m as fp16): not block codes, though
    # every weight is d q + m exactly in fp32
    b = exact.T.reshape(960, -1, 32)
    lo = b.amin(-1, keepdim=True)
    shifted = (b - lo + (lo + 2.0 ** -20)).reshape(960, 576).T.contiguous()
    assert not torch.equal(shifted, exact) and find_block_codes(shifted) is None
    assert find_block_codes(exact[:, :48]) is None  # out not a multiple of 32
    assert find_block_codes(exact.double()) is None
    codes = find_block_codes(exact)
    assert blockcode_linear(torch.randn(LINEAR_MAX_ROWS + 1, 576), codes) is None  # prefill: PyTorch's product
    assert blockcode_linear(torch.randn(2, 575), codes) is None
    assert blockcode_linear(torch.randn(2, 576, dtype=torch.float64), codes) is None


def test_model_with_codes_matches_transformers_and_its_fp32_self():
    hf = gguf_like(hf_model(seed=3, vocab=96, layers=2))
    plain, coded = ours(hf), ours(hf)
    n = coded.attach_block_codes()
    linears = [m for m in coded.modules() if isinstance(m, Linear)]
    assert n == len(linears) == 2 * 4 + 1  # qkv, o, gate_up, down per layer and the LM head
    ids = torch.randint(3, 96, (1, 80), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
    steps = {}
    for name, model in (("plain", plain), ("coded", coded)):
        cache = FullKVCache(model.cfg, 96)
        first = model(ids[:, :72], torch.arange(72), cache)  # prefill (72 rows): the fp32 weights
        block = model(ids[:, 72:79], torch.arange(72, 79), cache)  # a verification block: the codes
        step = model(ids[:, 79:80], torch.tensor([79]), cache)  # a decode step: the codes
        torch.testing.assert_close(torch.cat([first, block, step], 1), ref, rtol=1e-4, atol=1e-4)
        steps[name] = step
    torch.testing.assert_close(steps["coded"], steps["plain"], rtol=1e-5, atol=1e-5)
    assert ours(hf_model(seed=3, vocab=96, layers=2)).attach_block_codes() == 0  # random fp32 weights: none


def test_codes_keep_every_mode_equal_to_autoregressive_greedy(monkeypatch):
    """Autoregressive decoding on codes (its decode steps in one call) against every mode: the retrieval tier on the
    target's own codes (one call too, exact or with int8 activations) or its int8 copy, the draft, TriForce."""
    from triforce.kernels import decode_step

    _, draft = pair(seed=5)
    target = ours(gguf_like(hf_model(5, vocab=96, layers=3)))
    assert target.attach_block_codes() == 3 * 4 + 1
    ran = []
    real = decode_step.decode_layers
    monkeypatch.setattr(decode_step, "decode_layers", lambda *a: (r := real(*a), ran.append(r is not None))[0])
    engine = Engine(target, draft)
    g = torch.Generator().manual_seed(5)
    greedy = SamplingParams(temperature=0)
    accepted = 0
    for _ in range(8):
        prompt = torch.randint(3, 96, (int(torch.randint(8, 80, (1,), generator=g)),), generator=g).tolist()
        ref, _ = engine.generate(prompt, max_new_tokens=20, sampling=greedy)
        for mode, lower in (("retrieval", None), ("retrieval", "int8"), ("retrieval", "codes"), ("draft", None),
                            ("triforce", None), ("triforce", "codes")):
            spec = SpeculationConfig(mode=mode, budget=24, chunk_size=4, gamma1=3, gamma2=5, draft_sink=2,
                                     draft_window=8, lower_weights=lower)
            out, stats = engine.generate(prompt, max_new_tokens=20, sampling=greedy, spec=spec)
            assert out == ref, (mode, lower)
            accepted += stats.tiers["target"]["accepted"]
    assert accepted > 0
    if decode_step.decode_step_status().startswith("on"):
        assert ran and all(ran)


@pytest.mark.parametrize("lower", [None, "codes"])
def test_verifier_on_codes_matches_exact_distribution(lower):
    """TriForce with the verifier on block codes (V = 5: the LM head stays fp32, every layer reads codes), the
    retrieval tier on the same codes exactly or with int8 activations, at T = 0.6 / top-p 0.9 / top-k 5: the
    chi-square bound of ``distribution.py`` (p > 1e-3)."""
    target_hf = gguf_like(hf_model(seed=21, vocab=V, layers=2, hidden=32, init=0.15))
    draft = ours(hf_model(seed=22, vocab=V, layers=1, hidden=16, heads=2, kv_heads=1, init=0.5))
    target = ours(target_hf)
    assert target.attach_block_codes() == 2 * 4
    prompt = torch.randint(0, V, (20,), generator=torch.Generator().manual_seed(5)).tolist()
    params = SETTINGS["T0.6-p0.9-k5"]
    spec = SpeculationConfig(mode="triforce", budget=8, chunk_size=2, gamma1=2, gamma2=2, draft_sink=2, draft_window=4,
                             lower_weights=lower)
    counts = empirical(Engine(target, draft), prompt, params, spec, 2000, seed=91)
    assert counts.sum() == 2000 and NEW == 3
    assert chi2_pvalue(counts, exact_distribution(target_hf, prompt, params)) > 1e-3


@pytest.mark.parametrize("family,heads,kv_heads,kv_dtype", [("llama", 4, 2, torch.float32),
                                                             ("qwen2", 4, 1, torch.float32),
                                                             ("llama", 4, 2, torch.bfloat16)])
def test_decode_step_on_codes_in_one_call_is_the_python_layers(family, heads, kv_heads, kv_dtype, monkeypatch):
    """csrc/decode_step.c over block codes: a full-cache decode step and a 7-token verification block (the
    verifier's), a retrieval step (the target over its retrieval cache) and blocks of 2-5 tokens over it (its own
    layout: generated tokens from the end; full slots or empty ones) give the Python layers' logits, keys and
    recorded queries to float rounding (SiLU's exp is Cephes' on one side), with the same argmax; qwen2:
    projections with random biases the kernel must add. bf16 caches (``--kv-dtype``, a lower tier's
    ``lower_kv_dtype``): the first layer's keys and values written bitwise as ``Tensor.to`` rounds them (later
    layers' may differ by one bf16 rounding step, from SiLU's last bit), and where the Python layers attend with
    the same kernel the same logits to float rounding; the retrieval tier's blocks of several tokens, which Python
    attends with SDPA in bf16 (queries rounded too), to bf16 rounding."""
    from triforce.kernels import decode_step
    from triforce.kv.retrieval import RetrievalCache

    if not decode_step.decode_step_status().startswith("on"):
        pytest.skip(f"decode step kernel {decode_step.decode_step_status()}")
    hf = gguf_like(hf_model(8, vocab=96, layers=3, family=family, heads=heads, kv_heads=kv_heads))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    target = ours(hf)
    target.attach_block_codes()
    assert target.decode_step is not None
    n = 40
    prompt = torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(3))
    full = FullKVCache(target.cfg, 64, dtype=kv_dtype, record_queries=True)
    target(prompt[None], torch.arange(n), full)
    ret = RetrievalCache(target.cfg, full, 16, 4)
    ret.build_from_full(n - 1)
    target(prompt[None, -1:], torch.tensor([n - 1]), ret)  # a generated slot too
    roomy = RetrievalCache(target.cfg, full, 48, 4)  # more slots than the prompt: empty ones between
    assert ret.k.dtype == roomy.k.dtype == kv_dtype
    roomy.build_from_full(n - 1)
    target(prompt[None, -1:], torch.tensor([n - 1]), roomy)
    full.record_queries = False
    ran = []
    real = decode_step.decode_layers
    monkeypatch.setattr(decode_step, "decode_layers", lambda *a: (r := real(*a), ran.append(r is not None))[0])
    step = target.decode_step
    block = torch.tensor([[7, 50, 3, 9, 9, 61, 20]])  # a verification block over the full cache
    # a decode step, a retrieval step, a verification block; the retrieval tier's blocks (verifying an n-gram
    # drafter's tokens, catching up after a verification) over full slots and over a cache with empty ones
    for cache, length, ids in ((full, n, block[:, :1]), (ret, n, block[:, :1]), (full, n, block),
                               (ret, n, block[:, :5]), (ret, n, block[:, :2]), (roomy, n, block[:, :1]),
                               (roomy, n, block[:, :4])):
        outs = []
        for fused in (True, False):
            target.decode_step = step if fused else None
            logits = target(ids, torch.arange(length, length + ids.shape[1]), cache)
            outs.append((logits, cache.k.clone(), cache.v.clone()))
            cache.rollback(length)
        assert ran.pop() is True
        sdpa_bf16 = kv_dtype == torch.bfloat16 and cache is not full and ids.shape[1] > 1
        tol = 2e-2 if sdpa_bf16 else 1e-5
        torch.testing.assert_close(outs[0][0], outs[1][0], rtol=tol, atol=tol * outs[1][0].abs().max().item())
        if kv_dtype == torch.bfloat16:
            for a, b in zip(outs[0][1:], outs[1][1:]):  # keys, values: layer 0 bitwise, the others within a step
                assert torch.equal(a[0], b[0])
                torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-2 * b.float().abs().max().item())
        else:
            for a, b in zip(outs[0][1:], outs[1][1:]):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())
        if not sdpa_bf16:
            assert torch.equal(outs[0][0].argmax(-1), outs[1][0].argmax(-1))
    full.record_queries = True  # the queries are kept (the retrieval cache's chunk selection): the call writes them
    queries = []
    for fused in (True, False):
        target.decode_step = step if fused else None
        target(block, torch.arange(n, n + 7), full)
        queries.append(torch.stack([full.query_at(n + i) for i in range(7)]))  # (7, L, 1, nh, hs)
        full.rollback(n)
    assert ran == [True]
    torch.testing.assert_close(queries[0], queries[1], rtol=1e-5, atol=1e-5)


def test_int8_activation_copy_runs_its_decode_step_in_one_call(monkeypatch):
    """lower_precision_copy(model, "codes"): the same tensors (no copy of the weights), every projection with int8
    activations; its one-call decode step and retrieval blocks run, and give logits as close to its Python layers'
    as those are to the exact model's (not to float rounding: SiLU's exp rounds differently on the two sides, and
    a last-bit change can move an activation across an int8 rounding step); a model without codes gets the int8
    copy."""
    from triforce.kernels import decode_step
    from triforce.kv.retrieval import RetrievalCache
    from triforce.model.quant import lower_precision_copy

    if not decode_step.decode_step_status().startswith("on"):
        pytest.skip(f"decode step kernel {decode_step.decode_step_status()}")
    target = ours(gguf_like(hf_model(9, vocab=96, layers=3)))
    target.attach_block_codes()
    copy = lower_precision_copy(target, "codes")
    assert copy.decode_step is not None and copy.layers_on_codes()
    lins = [m for m in copy.modules() if isinstance(m, Linear)]
    assert all(m.q8 for m in lins) and not any(m.q8 for m in target.modules() if isinstance(m, Linear))
    assert {m.codes.codes.data_ptr() for m in lins} == {m.codes.codes.data_ptr() for m in target.modules()
                                                        if isinstance(m, Linear)}
    n = 40
    prompt = torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(4))
    full = FullKVCache(target.cfg, 64, record_queries=True)
    target(prompt[None], torch.arange(n), full)
    ret = RetrievalCache(target.cfg, full, 16, 4)
    ret.build_from_full(n - 1)
    ran = []
    real = decode_step.decode_layers
    monkeypatch.setattr(decode_step, "decode_layers", lambda *a: (r := real(*a), ran.append(r is not None))[0])
    block = torch.tensor([[7, 50, 3, 9, 9]])
    step = copy.decode_step
    target.decode_step = None
    for ids in (block[:, :1], block):
        pos = torch.arange(n - 1, n - 1 + ids.shape[1])
        outs = []
        for fused in (True, False):
            copy.decode_step = step if fused else None
            outs.append(copy(ids, pos, ret))
            ret.rollback(n - 1)
        assert ran.pop() is True
        exact = target(ids, pos, ret)
        ret.rollback(n - 1)
        fused, python = outs
        assert (python - exact).norm() <= 0.2 * exact.norm()
        assert (fused - python).norm() <= (python - exact).norm()
    plain = ours(hf_model(seed=3, vocab=96, layers=2))
    assert lower_precision_copy(plain, "codes").weights == "int8"
