"""bf16 and fp16 checkpoints kept at 2 bytes a weight (blockcodes.py width 16, csrc/blockcodes.c).

An fp32 model loaded on the CPU from a bf16/fp16 checkpoint keeps its matrices as the file stores them and widens each
weight exactly in registers. The products must be bitwise our fp32 kernel's over the widened weights, for every row
count the kernel takes, on the AVX-512 and AVX2 builds; the loaded model must give transformers' logits of the same
checkpoint read in fp32, and every speculative mode must equal autoregressive greedy decoding on it.
"""

import pytest
import torch

from triforce.kernels import blockcodes
from triforce.kernels.blockcodes import blockcode_linear
from triforce.kernels.codes import codes_from_16bit, concat_outputs
from triforce.kernels.cpu import LINEAR_MAX_ROWS, f32_linear
from triforce.kernels.stored import Rows16
from triforce.model.transformer import Linear

pytestmark = pytest.mark.skipif(not blockcodes.blockcodes_status().startswith("on"),
                                reason=f"block-code kernel: {blockcodes.blockcodes_status()}")

DTYPES = [torch.bfloat16, torch.float16]


def random_weight(n_out: int, n_in: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """(out, in) weights of ``dtype``, magnitudes over several binades, some zeros and negative zeros."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n_out, n_in, generator=g) * 2.0 ** torch.randint(-12, 2, (n_out, n_in), generator=g)
    w[torch.rand(n_out, n_in, generator=g) < 0.02] = 0.0
    w[torch.rand(n_out, n_in, generator=g) < 0.01] = -0.0
    return w.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_two_byte_weights_widen_exactly_and_the_product_is_fp32_bitwise(dtype, blockcode_build):
    n_out, n_in = 96, 512
    w = random_weight(n_out, n_in, dtype)
    codes = codes_from_16bit(w)
    assert codes.bits == 16 and codes.codes.dtype == dtype and codes.nbytes == 2 * w.numel()
    w_t = w.float().T.contiguous()
    assert torch.equal(codes.dequantize(), w_t)
    assert torch.equal(codes.dequantize(3, 7), w_t[:, 24:56])
    gen = torch.Generator().manual_seed(1)
    for rows in (1, 2, 3, 4, 7, 8, 9, 16, LINEAR_MAX_ROWS):
        x = torch.randn(rows, n_in, generator=gen)
        y = blockcode_linear(x, codes)
        assert y is not None and torch.equal(y, f32_linear(x, w_t)), (dtype, rows)
        bound = n_in * 2.0 ** -24 * x.double().abs().mm(w_t.double().abs())  # fp32 summation bound
        assert ((y.double() - x.double().mm(w_t.double())).abs() <= bound).all(), (dtype, rows)


def test_fused_two_byte_matrices_and_what_they_refuse():
    parts = [random_weight(o, 256, torch.bfloat16, seed=o) for o in (64, 32, 32)]
    fused = concat_outputs([codes_from_16bit(p) for p in parts])
    w_t = torch.cat(parts).float().T.contiguous()
    assert torch.equal(fused.dequantize(), w_t)
    x = torch.randn(5, 256)
    assert torch.equal(blockcode_linear(x, fused), f32_linear(x, w_t))
    with pytest.raises(ValueError, match="2-byte weights"):
        concat_outputs([codes_from_16bit(parts[0]), codes_from_16bit(parts[1].half())])
    assert codes_from_16bit(parts[0].float()) is None  # fp32: not kept as 2-byte weights
    assert codes_from_16bit(torch.zeros(40, 256, dtype=torch.bfloat16)) is None  # outputs not a multiple of 32


def test_linear_without_fp32_weights_multiplies_many_rows_by_widened_tiles():
    w = random_weight(2080, 256, torch.bfloat16, seed=4)  # more outputs than one tile
    lin = Linear(256, 2080)
    lin.weight_t, lin.codes = None, codes_from_16bit(w)
    x = torch.randn(1, 100, 256)  # more rows than the kernel takes: prefill
    torch.testing.assert_close(lin(x), x @ w.float().T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_embedding_rows_widen_exactly_from_a_table_or_a_tied_head(dtype):
    w = random_weight(64, 96, dtype, seed=2)
    ids = torch.tensor([[5, 0], [63, 5]])
    for rows in (Rows16(table=w), Rows16(codes=codes_from_16bit(w))):
        assert torch.equal(rows(ids), w.float()[ids])
    with pytest.raises(ValueError, match="Rows16"):
        Rows16()


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def bf16_qwen2(request, tmp_path_factory):
    """``(folder, transformers model)``: a tiny Qwen2 model saved in bf16 (biases, GQA), and transformers' model of
    it read in fp32."""
    from transformers import AutoModelForCausalLM

    from tiny import char_tokenizer, hf_model

    path = tmp_path_factory.mktemp("bf16")
    hf_model(seed=3, family="qwen2", vocab=96, layers=2, tie=request.param).to(torch.bfloat16).save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    return str(path), hf


def test_bf16_checkpoint_is_kept_at_two_bytes_and_gives_transformers_logits(bf16_qwen2):
    from triforce.formats.loading import load_model
    from triforce.kv.caches import FullKVCache

    path, hf = bf16_qwen2
    model = load_model(path).model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert all(m.weight_t is None and m.codes.bits == 16 for m in linears)
    assert isinstance(model.embed_tokens, Rows16)
    fp32_bytes = sum(p.numel() for p in hf.parameters()) * 4  # transformers' tied head is one matrix
    assert model.weight_bytes() < 0.52 * fp32_bytes
    ids = torch.randint(3, 96, (1, 90), generator=torch.Generator().manual_seed(2))
    cache = FullKVCache(model.cfg, 96)
    with torch.no_grad():
        ours = torch.cat([model(ids[:, :80], torch.arange(80), cache),  # prefill: widened tiles
                          model(ids[:, 80:89], torch.arange(80, 89), cache),  # a block: the 2-byte weights
                          model(ids[:, 89:], torch.tensor([89]), cache)], 1)  # a decode step
        want = hf(ids).logits
    torch.testing.assert_close(ours, want, rtol=1e-4, atol=1e-4)


def test_speculative_modes_on_bf16_weights_equal_autoregressive_greedy(bf16_qwen2):
    from triforce.engine import Engine, SpeculationConfig
    from triforce.formats.loading import load_model
    from triforce.speculation.sampling import SamplingParams

    engine = Engine(load_model(bf16_qwen2[0]).model)
    g, greedy = torch.Generator().manual_seed(5), SamplingParams(temperature=0)
    for _ in range(3):
        prompt = torch.randint(3, 96, (int(torch.randint(8, 70, (1,), generator=g)),), generator=g).tolist()
        ref, _ = engine.generate(prompt, max_new_tokens=16, sampling=greedy)
        for lower in (None, "codes", "int8"):
            spec = SpeculationConfig(mode="retrieval", budget=24, chunk_size=4, gamma1=3, gamma2=5, draft_sink=2,
                                     draft_window=8, lower_weights=lower)
            out, _ = engine.generate(prompt, max_new_tokens=16, sampling=greedy, spec=spec)
            assert out == ref, lower


def test_auto_weighs_the_int8_tier_by_its_copys_bytes_not_the_stored_ones(bf16_qwen2):
    """The int8 tier under a 2-byte verifier reads one byte a weight (half the verifier's), not a quarter as an fp32
    verifier's bytes over 4 would say: ``int8_copy_bytes`` counts the copy ``lower_precision_copy`` makes."""
    from triforce.formats.loading import load_model
    from triforce.model.quant import int8_copy_bytes, lower_precision_copy

    model = load_model(bf16_qwen2[0]).model
    copy = lower_precision_copy(model, "int8")
    made = sum(p.numel() * p.element_size() for lin in [copy.lm_head] + [
        m for b in copy.layers for m in (b.self_attn.qkv_proj, b.self_attn.o_proj, b.mlp.gate_up_proj, b.mlp.down_proj)]
        for p in (lin.q, lin.scale_f32))
    assert int8_copy_bytes(model) == made == int8_copy_bytes(copy)
    stored = [model.lm_head] + [m for b in model.layers
                                for m in (b.self_attn.qkv_proj, b.self_attn.o_proj, b.mlp.gate_up_proj,
                                          b.mlp.down_proj)]
    assert made == sum(lin.codes.nbytes // 2 + 4 * lin.codes.out_features for lin in stored)  # 1 byte against 2
