"""GGUF block types read as the file stores them (ggufcodes.py, csrc/blockcodes.c).

Blocks of every type the loader reads as codes are built from random bytes (random codes, scales and minima; fp16
fields set to finite values of both signs, zero and subnormals among them). The codes must dequantize to exactly
gguf-py's ``dequantize`` of the same bytes, and the kernel's product must be bitwise our fp32 kernel's over those
weights, for every row count the kernel takes, on the AVX-512 and AVX2 builds, and after two types are fused into
one product (q/k/v of mixed types, as a Q4_K_M file has them).
"""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize as gguf_dequantize

from triforce.formats.ggufcodes import CODED_TYPES, GGUFRows, codes_from_gguf
from triforce.kernels import blockcodes
from triforce.kernels.blockcodes import blockcode_linear
from triforce.kernels.codes import concat_outputs
from triforce.kernels.cpu import LINEAR_MAX_ROWS, f32_linear
from triforce.model.transformer import Linear

pytestmark = pytest.mark.skipif(not blockcodes.blockcodes_status().startswith("on"),
                                reason=f"block-code kernel: {blockcodes.blockcodes_status()}")

#: bytes a block and the offsets of its fp16 fields (ggml-common.h's block structs)
LAYOUT = {QT.Q4_0: (18, (0,)), QT.Q4_1: (20, (0, 2)), QT.Q5_0: (22, (0,)), QT.Q8_0: (34, (0,)),
          QT.Q4_K: (144, (0, 2)), QT.Q5_K: (176, (0, 2)), QT.Q6_K: (210, (208,))}
BLOCK = {QT.Q4_0: 32, QT.Q4_1: 32, QT.Q5_0: 32, QT.Q8_0: 32, QT.Q4_K: 256, QT.Q5_K: 256, QT.Q6_K: 256}


def random_blocks(qtype: QT, n_out: int, n_in: int, seed: int = 0) -> np.ndarray:
    """(n_out, bytes a row) uint8: random blocks of ``qtype`` whose fp16 fields are finite (magnitudes 2^-24 .. 2^-2,
    both signs, some zero)."""
    rng = np.random.default_rng(seed)
    size, halves = LAYOUT[qtype]
    nb = n_in // BLOCK[qtype]
    raw = rng.integers(0, 256, size=(n_out, nb, size), dtype=np.uint8)
    for off in halves:
        v = (rng.choice([-1.0, 1.0], size=(n_out, nb)) * 2.0 ** rng.uniform(-24, -2, size=(n_out, nb)))
        v[rng.random((n_out, nb)) < 0.02] = 0.0
        raw[..., off:off + 2] = v.astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(n_out, nb * size)


def dense(raw: np.ndarray, qtype: QT, n_in: int) -> torch.Tensor:
    """gguf-py's dequantized (out, in) fp32 weights of the blocks."""
    return torch.from_numpy(np.asarray(gguf_dequantize(raw, qtype), dtype=np.float32).reshape(raw.shape[0], n_in))


@pytest.mark.parametrize("qtype", CODED_TYPES, ids=lambda t: t.name)
def test_codes_are_gguf_dequantize_and_the_product_is_fp32_bitwise(qtype, blockcode_build):
    n_out, n_in = 96, 512
    raw = random_blocks(qtype, n_out, n_in, seed=int(qtype))
    w = dense(raw, qtype, n_in)  # (out, in)
    codes = codes_from_gguf(raw, qtype, n_in)
    assert torch.equal(codes.dequantize(), w.T)  # the kernel's dequantization
    assert torch.equal(codes.dequantize(3, 7), w.T[:, 24:56])  # a tile of column blocks
    w_t = w.T.contiguous()
    gen = torch.Generator().manual_seed(1)
    for rows in (1, 2, 3, 4, 7, 8, 9, 16, LINEAR_MAX_ROWS):
        x = torch.randn(rows, n_in, generator=gen)
        y = blockcode_linear(x, codes)
        assert y is not None, (qtype.name, rows)
        assert torch.equal(y, f32_linear(x, w_t)), (qtype.name, rows)
        # and within the fp32 summation bound of the exact product: |error| <= in eps sum_i |x_i w_io|
        bound = n_in * 2.0 ** -24 * x.double().abs().mm(w_t.double().abs())
        assert ((y.double() - x.double().mm(w_t.double())).abs() <= bound).all(), (qtype.name, rows)


@pytest.mark.parametrize("qtype", CODED_TYPES, ids=lambda t: t.name)
def test_int8_activation_products_of_every_type_compute_their_definition(qtype, blockcode_build):
    """blockcode_linear_q8 (the ``file`` precision, the tiers below the verifier) over a GGUF type's own codes:
    llama.cpp's formula computed in float64 to fp32 rounding (Q6_K's groups of 16 included), a row alone = the row in
    a block, within a few percent of the exact product."""
    from references import q8_dot_reference
    from triforce.kernels.blockcodes import blockcode_linear_q8

    n_out, n_in = 96, 512
    raw = random_blocks(qtype, n_out, n_in, seed=int(qtype) + 50)
    if qtype == QT.Q8_0:  # codes of -128, which ggml's quantization never writes, go to the exact product
        q = raw.reshape(n_out, -1, 34)[..., 2:]
        q[q == 0x80] = 0x81
    raw_w = dense(raw, qtype, n_in)
    scale = float(raw_w.abs().max())
    codes = codes_from_gguf(raw, qtype, n_in)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(7, n_in, generator=gen)
    assert codes.q8_dot_ok
    # the reference reads fp32 scales: a K-quant's stored pairs as their products (the same weights and scales)
    as_f32 = codes.promoted(codes.bits, True, codes.group, codes.m is not None) if codes.d_super is not None else codes
    for rows in (1, 2, 4, 7):
        y = blockcode_linear_q8(x[:rows], codes)
        ref = q8_dot_reference(x[:rows], as_f32)
        assert (y.double() - ref).abs().max() <= 1e-5 * ref.abs().max() + 1e-6 * scale, (qtype.name, rows)
        assert torch.equal(blockcode_linear_q8(x[rows - 1:rows], codes), y[-1:])
        exact = blockcode_linear(x[:rows], codes)
        assert (y - exact).norm() <= 0.05 * exact.norm(), (qtype.name, rows)


#: bytes a weight of each K-quant as BlockCodes keeps it: codes, then per group an int8 scale (and minimum), per 256
#: inputs an fp16 scale (and minimum), as the file does (Q6_K: groups of 16)
K_BYTES = {QT.Q4_K: 0.5 + 2 * (1 / 32 + 2 / 256), QT.Q5_K: 1 + 2 * (1 / 32 + 2 / 256), QT.Q6_K: 1 + 1 / 16 + 2 / 256}


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q5_K, QT.Q6_K], ids=lambda t: t.name)
def test_k_quant_scales_are_kept_as_the_file_stores_them(qtype, blockcode_build, monkeypatch):
    """A K-quant's scales as int8 group values and fp16 super-block values in one buffer (the kernel's BC_KS), at the
    bytes a weight of K_BYTES; their products are the fp32 d sc and -(dmin mc) gguf-py forms, bitwise; the kernel's
    products and the PyTorch fallback (the kernel off) both give gguf-py's weights."""
    n_out, n_in = 64, 768
    raw = random_blocks(qtype, n_out, n_in, seed=int(qtype) + 9)
    codes = codes_from_gguf(raw, qtype, n_in)
    assert codes.kernel_bits & blockcodes.BC_KS and codes.d.dtype == torch.int8
    assert codes.d_super.dtype == torch.float16 and tuple(codes.d_super.shape) == (n_out // 8, n_in // 256, 8)
    assert codes.nbytes == n_out * n_in * K_BYTES[qtype]
    # one buffer a pair: the fp16 values right after the int8 ones (the kernel's one pointer)
    for sub, sup in ((codes.d, codes.d_super), (codes.m, codes.m_super)):
        if sub is not None:
            assert sup.data_ptr() == sub.data_ptr() + sub.numel()
    # the scales: fp16 d (dmin) of each 256 inputs times the group's integer, computed in fp32 as gguf-py does
    b = raw.reshape(n_out, n_in // 256, -1)
    if qtype == QT.Q6_K:
        want_d = (b[..., 208:210].copy().view(np.float16).astype(np.float32)
                  * b[..., 192:208].copy().view(np.int8).astype(np.float32)).reshape(n_out, -1)
        want_m = None
    else:
        from triforce.formats.ggufcodes import _k_scale_min
        sc, mn = _k_scale_min(b[..., 4:16])
        want_d = (b[..., 0:2].copy().view(np.float16).astype(np.float32) * sc.astype(np.float32)).reshape(n_out, -1)
        want_m = -(b[..., 2:4].copy().view(np.float16).astype(np.float32) * mn.astype(np.float32)).reshape(n_out, -1)
    d, m = codes.group_scales()
    as_rows = lambda t: t.permute(0, 2, 1).reshape(n_out, -1)  # noqa: E731  (out / 8, groups, 8) -> (out, groups)
    assert torch.equal(as_rows(d), torch.from_numpy(want_d))
    assert (m is None) == (want_m is None) and (m is None or torch.equal(as_rows(m), torch.from_numpy(want_m)))
    w_t = dense(raw, qtype, n_in).T.contiguous()
    x = torch.randn(3, n_in, generator=torch.Generator().manual_seed(4))
    assert torch.equal(blockcode_linear(x, codes), f32_linear(x, w_t))
    monkeypatch.setattr(blockcodes._blockcodes, "load", lambda: None)  # the kernel off: PyTorch's dequantization
    assert torch.equal(codes.dequantize(), w_t) and torch.equal(codes.dequantize(2, 5), w_t[:, 16:40])


@pytest.mark.parametrize("types", [(QT.Q4_K, QT.Q4_K, QT.Q6_K), (QT.Q5_0, QT.Q5_0, QT.Q8_0), (QT.Q4_1, QT.Q8_0),
                                   (QT.Q4_K, QT.Q5_0), (QT.Q4_0, QT.Q5_K), (QT.Q4_K, QT.Q5_K), (QT.Q6_K, QT.Q6_K),
                                   (QT.Q6_K, QT.Q4_K, QT.Q5_0)], ids=lambda ts: "+".join(t.name for t in ts))
def test_fused_matrices_of_mixed_types_keep_every_weight(types, blockcode_build):
    n_in, outs = 256, [64, 32, 32][:len(types)]
    parts = [random_blocks(t, o, n_in, seed=i) for i, (t, o) in enumerate(zip(types, outs))]
    fused = concat_outputs([codes_from_gguf(r, t, n_in) for r, t in zip(parts, types)])
    k_quants = {QT.Q4_K, QT.Q5_K, QT.Q6_K}
    # K-quants among themselves keep their stored scales; beside the fp16-scale types, their fp32 products
    assert (fused.d_super is not None) == (set(types) <= k_quants)
    assert (fused.d.dtype == torch.float32) == (bool(set(types) & k_quants) and not set(types) <= k_quants)
    w_t = torch.cat([dense(r, t, n_in) for r, t in zip(parts, types)]).T.contiguous()
    assert torch.equal(fused.dequantize(), w_t)
    for rows in (1, 5, 12):
        x = torch.randn(rows, n_in, generator=torch.Generator().manual_seed(rows))
        assert torch.equal(blockcode_linear(x, fused), f32_linear(x, w_t))
    if fused.q8_dot_ok:  # the file's arithmetic over the fusion: its definition, and each row as it is alone
        from references import q8_dot_reference
        from triforce.kernels.blockcodes import blockcode_linear_q8

        as_f32 = fused.promoted(fused.bits, True, fused.group, fused.m is not None)
        x = torch.randn(9, n_in, generator=torch.Generator().manual_seed(9))
        y, ref = blockcode_linear_q8(x, fused), q8_dot_reference(x, as_f32)
        assert (y.double() - ref).abs().max() <= 1e-5 * ref.abs().max() + 1e-6 * float(w_t.abs().max())
        assert all(torch.equal(blockcode_linear_q8(x[i:i + 1], fused), y[i:i + 1]) for i in range(9))


#: the GGUF types and fusions of them (a Q4_K_M file's q/k/v and its Q6_K matrices) whose int8-activation products
#: must be bitwise alike on every build
Q8_CASES = [(t,) for t in CODED_TYPES] + [(QT.Q4_K, QT.Q4_K, QT.Q6_K), (QT.Q6_K, QT.Q4_K, QT.Q5_0), (QT.Q4_K, QT.Q5_0)]


def test_int8_activation_products_are_bitwise_alike_on_every_build_and_row_count(monkeypatch):
    """The file's arithmetic (blockcode_linear_q8) on every build this CPU runs, the portable one included: the same
    integer sums (vpdpbusd, vpmaddubsw + vpmaddwd, or C) and the same float steps (a multiply and an add, in group
    order), so each row's result is bitwise the same on every build, in every row count and thread count, and equal
    to the row computed alone (the row invariance the verifier's ``file`` precision relies on)."""
    from triforce.kernels.blockcodes import blockcode_linear_q8

    n_in = 512
    cases = []
    for i, types in enumerate(Q8_CASES):
        parts = [random_blocks(t, 32 if len(types) > 1 else 96, n_in, seed=100 + i + j) for j, t in enumerate(types)]
        for raw, t in zip(parts, types):
            if t == QT.Q8_0:  # no codes of -128 (ggml never writes them; the kernel refuses them)
                q = raw.reshape(raw.shape[0], -1, 34)[..., 2:]
                q[q == 0x80] = 0x81
        codes = concat_outputs([codes_from_gguf(r, t, n_in) for r, t in zip(parts, types)])
        assert codes.q8_dot_ok, types
        cases.append(codes)
    x = torch.randn(LINEAR_MAX_ROWS, n_in, generator=torch.Generator().manual_seed(3))
    x[1, 64:96] = 0  # a block of zeros: scale 0
    threads = torch.get_num_threads()
    results = {}
    try:
        for isa in blockcodes._BUILDS:
            build = blockcodes.blockcodes_build(isa)
            if build.load() is None:
                continue
            monkeypatch.setattr(blockcodes, "_blockcodes", build)
            for n_threads in (1, 2, 3):
                torch.set_num_threads(n_threads)
                for c, codes in enumerate(cases):
                    full = blockcode_linear_q8(x, codes)
                    results.setdefault((isa, c), []).append(full)
                    for rows in (1, 2, 3, 4, 5, 7, 9):
                        assert torch.equal(blockcode_linear_q8(x[:rows], codes), full[:rows]), (isa, c, rows)
                    assert torch.equal(blockcode_linear_q8(x[-1:], codes), full[-1:]), (isa, c)
    finally:
        torch.set_num_threads(threads)
    builds = {isa for isa, _ in results}
    assert "portable" in builds
    for c in range(len(cases)):
        first = results[(next(iter(builds)), c)][0]
        for isa in builds:
            assert all(torch.equal(y, first) for y in results[(isa, c)]), (isa, Q8_CASES[c])


def test_linear_without_fp32_weights_multiplies_many_rows_by_dequantized_tiles():
    n_out, n_in = 2080, 256  # more outputs than one tile
    raw = random_blocks(QT.Q4_K, n_out, n_in, seed=5)
    lin = Linear(n_in, n_out, bias=True)
    lin.weight_t = None
    lin.codes = codes_from_gguf(raw, QT.Q4_K, n_in)
    lin.bias = torch.nn.Parameter(torch.randn(n_out))
    x = torch.randn(1, 100, n_in)  # more rows than the kernel takes: prefill
    want = x @ dense(raw, QT.Q4_K, n_in).T + lin.bias
    torch.testing.assert_close(lin(x), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K, QT.Q5_0, QT.Q8_0], ids=lambda t: t.name)
def test_embedding_rows_are_the_dequantized_rows(qtype):
    raw = random_blocks(qtype, 64, 256, seed=3)
    rows = GGUFRows(raw, qtype, 256)
    ids = torch.tensor([5, 0, 63, 5])
    assert torch.equal(rows.rows(ids), dense(raw, qtype, 256)[ids])


def write_tiny_gguf(path, arch: str, types: dict, seed: int = 0) -> None:
    """A tiny GGUF file (2 layers, hidden 256, 4 heads, 2 KV heads, vocabulary 320) whose matrices are random
    blocks of the given types (name suffix -> type; F32 for the rest), with the metadata transformers' reader needs."""
    from gguf import GGUFWriter

    hidden, inter, heads, kv, vocab, layers = 256, 512, 4, 2, 320, 2
    w = GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(vocab)
    rng = np.random.default_rng(seed)
    hd = hidden // heads
    shapes = {"token_embd.weight": (vocab, hidden), "output.weight": (vocab, hidden)}
    for i in range(layers):
        shapes.update({f"blk.{i}.attn_q.weight": (hidden, hidden), f"blk.{i}.attn_k.weight": (kv * hd, hidden),
                       f"blk.{i}.attn_v.weight": (kv * hd, hidden), f"blk.{i}.attn_output.weight": (hidden, hidden),
                       f"blk.{i}.ffn_gate.weight": (inter, hidden), f"blk.{i}.ffn_up.weight": (inter, hidden),
                       f"blk.{i}.ffn_down.weight": (hidden, inter)})
    for n, (o, i) in shapes.items():
        qtype = next((t for suffix, t in types.items() if n.endswith(suffix)), None)
        if qtype is None:
            w.add_tensor(n, (rng.standard_normal((o, i)) * 0.05).astype(np.float32))
        else:
            w.add_tensor(n, random_blocks(qtype, o, i, seed=len(n)), raw_dtype=qtype)
    for i in range(layers):
        for n in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{n}.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
        if arch == "qwen2":
            for n, o in (("attn_q", hidden), ("attn_k", kv * hd), ("attn_v", kv * hd)):
                w.add_tensor(f"blk.{i}.{n}.bias", (0.1 * rng.standard_normal(o)).astype(np.float32))
    w.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tensors_read_as_stored_are_transformers_tensors(arch, tmp_path):
    """Names, Llama's q/k row order, biases and the mixed types of a Q4_K_M-like file against transformers' reader
    (which dequantizes with gguf-py): every matrix bitwise."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from triforce.formats.ggufcodes import read_gguf_codes

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, arch, {"attn_v.weight": QT.Q6_K, "ffn_down.weight": QT.Q6_K, "output.weight": QT.Q8_0,
                                 "token_embd.weight": QT.Q4_K, "attn_q.weight": QT.Q4_K, "attn_k.weight": QT.Q5_0,
                                 "ffn_gate.weight": QT.Q4_K, "ffn_up.weight": QT.Q5_K, "attn_output.weight": QT.Q4_0})
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(tmp_path), gguf_file=path.name))
    ref = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]
    ours = read_gguf_codes(path, 4, 2, tied=False)
    assert set(ours) == set(ref)
    for name, value in ours.items():
        if isinstance(value, GGUFRows):
            got = value.rows(torch.arange(value.shape[0]))
        elif isinstance(value, torch.Tensor):
            got = value
        else:
            got = value.dequantize().T
        assert torch.equal(got, ref[name].float()), name


@pytest.fixture(scope="module")
def tiny_qwen_gguf(tmp_path_factory):
    """A tiny Qwen2 GGUF file of a Q4_K_M-like mix (tensors only), its ModelConfig, and transformers' dense state."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from triforce.model.config import ModelConfig

    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path, "qwen2", {"attn_v.weight": QT.Q6_K, "ffn_down.weight": QT.Q6_K, "output.weight": QT.Q6_K,
                                    "token_embd.weight": QT.Q4_K, "attn_q.weight": QT.Q4_K, "attn_k.weight": QT.Q4_K,
                                    "ffn_gate.weight": QT.Q4_K, "ffn_up.weight": QT.Q4_K,
                                    "attn_output.weight": QT.Q4_K},
                    seed=7)
    hf_config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(hf_config)
    dense = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]
    return path, ModelConfig.from_hf(hf_config), dense


def coded_model(path, cfg):
    """Our model over the file's codes (no fp32 weights), with its one-call decode step."""
    from triforce.formats.ggufcodes import read_gguf_codes
    from triforce.model.transformer import Transformer

    model = Transformer.from_state_dict(cfg, read_gguf_codes(path, cfg.num_attention_heads, cfg.num_key_value_heads,
                                                             cfg.tie_word_embeddings), consume=True)
    model.attach_block_codes()
    return model


def test_model_on_stored_weights_equals_the_dequantized_model(tiny_qwen_gguf):
    from triforce.kv.caches import FullKVCache
    from triforce.model.transformer import Transformer

    path, cfg, dense = tiny_qwen_gguf
    coded = coded_model(path, cfg)
    assert all(m.weight_t is None and m.codes is not None for m in coded.modules() if isinstance(m, Linear))
    plain = Transformer.from_state_dict(cfg, dict(dense))
    ids = torch.randint(0, 320, (1, 90), generator=torch.Generator().manual_seed(2))
    logits = {}
    for name, model in (("coded", coded), ("plain", plain)):
        cache = FullKVCache(model.cfg, 96)
        with torch.no_grad():
            logits[name] = torch.cat([model(ids[:, :80], torch.arange(80), cache),  # prefill: dequantized tiles
                                      model(ids[:, 80:89], torch.arange(80, 89), cache),  # a block: the codes
                                      model(ids[:, 89:], torch.tensor([89]), cache)], 1)  # a decode step
    torch.testing.assert_close(logits["coded"], logits["plain"], rtol=1e-4, atol=1e-4)
    assert coded.weight_bytes() < plain.weight_bytes() / 3  # codes, not fp32 copies


def test_retrieval_modes_on_stored_weights_equal_autoregressive_greedy(tiny_qwen_gguf):
    from triforce.engine import Engine, SpeculationConfig
    from triforce.speculation.sampling import SamplingParams

    path, cfg, _ = tiny_qwen_gguf
    engine = Engine(coded_model(path, cfg))
    g, greedy = torch.Generator().manual_seed(5), SamplingParams(temperature=0)
    for _ in range(4):
        prompt = torch.randint(0, 320, (int(torch.randint(8, 70, (1,), generator=g)),), generator=g).tolist()
        ref, _ = engine.generate(prompt, max_new_tokens=16, sampling=greedy)
        for mode, lower in (("retrieval", None), ("retrieval", "codes"), ("retrieval", "int8"), ("retrieval", "int4")):
            spec = SpeculationConfig(mode=mode, budget=24, chunk_size=4, gamma1=3, gamma2=5, draft_sink=2,
                                     draft_window=8, lower_weights=lower)
            out, _ = engine.generate(prompt, max_new_tokens=16, sampling=greedy, spec=spec)
            assert out == ref, (mode, lower)


def test_the_file_arithmetic_takes_every_product_of_a_q4_k_m_like_file(tiny_qwen_gguf):
    """``set_precision(model, "file")`` on a Q4_K_M-like file (Q4_K, a Q6_K v fused into qkv, Q6_K down and LM head):
    every product on int8 activations; a prefill's product (more rows than one kernel call takes) is bitwise each row's
    own product (prefill and decode steps are one model); the logits stay near the exact model's (the arithmetic is
    llama.cpp's, not fp32: top-1 agreement >= 0.9 on random tokens, and not equal); ``exact`` restores them bitwise."""
    from triforce.kernels.blockcodes import blockcode_linear_q8
    from triforce.kv.caches import FullKVCache
    from triforce.model.precision import set_precision

    path, cfg, _ = tiny_qwen_gguf
    model = coded_model(path, cfg)
    ids = torch.randint(0, 320, (1, 90), generator=torch.Generator().manual_seed(4))

    def logits():
        with torch.no_grad():
            return model(ids, torch.arange(90), FullKVCache(model.cfg, 96))[0]

    exact = logits()
    assert set_precision(model, "file") == "file" and model.precision == "file"
    lins = [m for m in model.modules() if isinstance(m, Linear) and m.codes is not None]
    assert lins and all(m.q8 for m in lins) and any(m.codes.group == 16 for m in lins)  # Q6_K's groups too
    file = logits()
    assert not torch.equal(file, exact) and (file.argmax(-1) == exact.argmax(-1)).double().mean() >= 0.9
    lin = model.layers[0].mlp.down_proj
    x = torch.randn(1, 150, lin.codes.in_features)
    whole = lin(x)[0]
    rows = torch.cat([blockcode_linear_q8(x[0, i:i + 1].clone(), lin.codes) for i in range(150)])
    assert torch.equal(whole, rows)
    assert set_precision(model, "exact") == "exact" and not any(m.q8 for m in lins)
    assert torch.equal(logits(), exact)


def test_retrieval_modes_on_the_file_arithmetic_equal_autoregressive_greedy(tiny_qwen_gguf):
    from triforce.engine import Engine, SpeculationConfig
    from triforce.model.precision import set_precision
    from triforce.speculation.sampling import SamplingParams

    path, cfg, _ = tiny_qwen_gguf
    model = coded_model(path, cfg)
    set_precision(model, "file")
    engine = Engine(model)
    g, greedy = torch.Generator().manual_seed(6), SamplingParams(temperature=0)
    for _ in range(3):
        prompt = torch.randint(0, 320, (int(torch.randint(8, 90, (1,), generator=g)),), generator=g).tolist()
        ref, _ = engine.generate(prompt, max_new_tokens=16, sampling=greedy)
        for mode, lower, drafter in (("retrieval", None, None), ("retrieval", "codes", None),
                                     ("triforce", None, "ngram"), ("draft", None, "ngram")):
            spec = SpeculationConfig(mode=mode, budget=24, chunk_size=4, gamma1=3, gamma2=5, draft_sink=2,
                                     draft_window=8, lower_weights=lower, **({"drafter": drafter} if drafter else {}))
            out, _ = engine.generate(prompt, max_new_tokens=16, sampling=greedy, spec=spec)
            assert out == ref, (mode, lower, drafter)


def test_precision_is_checked_before_the_weights_are_read(tmp_path, monkeypatch):
    """An unknown ``precision``, or ``file`` in another dtype or off the CPU: a ValueError naming the parameter and
    its values, before anything is read; ``file`` for weights that are not block codes names why."""
    import triforce.formats.loading as loading
    from tiny import hf_model, ours
    from triforce.model.precision import set_precision

    def never(*a, **k):
        raise AssertionError("read before the check")

    monkeypatch.setattr(loading, "_read_gguf_as", never)
    monkeypatch.setattr(loading, "_read_folder", never)
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF")
    with pytest.raises(ValueError, match=r"precision must be None .* file, exact, got 'fast'"):
        loading.load_model(str(path), precision="fast")
    with pytest.raises(ValueError, match=r"precision='file' .* not dtype bfloat16"):
        loading.load_model(str(path), dtype="bfloat16", precision="file")
    fp32 = ours(hf_model(0))  # random fp32 weights: no block codes
    fp32.attach_block_codes()
    with pytest.raises(ValueError, match="precision='file' needs a GGUF file's block codes"):
        set_precision(fp32, "file")
    assert set_precision(fp32, None) == "exact"
