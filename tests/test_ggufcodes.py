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

from conftest import use_avx2_build
from triforce import blockcodes
from triforce.blockcodes import blockcode_linear, concat_outputs
from triforce.ggufcodes import CODED_TYPES, GGUFRows, codes_from_gguf
from triforce.kernels import LINEAR_MAX_ROWS, f32_linear
from triforce.model import Linear

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


@pytest.fixture(params=["native", "avx2"])
def build(request, monkeypatch):
    """This CPU's build of the kernels, and the AVX2 build where the native one is AVX-512."""
    if request.param == "avx2":
        use_avx2_build(monkeypatch, blockcodes, "_blockcodes", blockcodes.blockcodes_status(),
                       blockcodes.blockcodes_build)
    return request.param


@pytest.mark.parametrize("qtype", CODED_TYPES, ids=lambda t: t.name)
def test_codes_are_gguf_dequantize_and_the_product_is_fp32_bitwise(qtype, build):
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


@pytest.mark.parametrize("types", [(QT.Q4_K, QT.Q4_K, QT.Q6_K), (QT.Q5_0, QT.Q5_0, QT.Q8_0), (QT.Q4_1, QT.Q8_0),
                                   (QT.Q4_K, QT.Q5_0), (QT.Q4_0, QT.Q5_K)], ids=lambda ts: "+".join(t.name for t in ts))
def test_fused_matrices_of_mixed_types_keep_every_weight(types, build):
    n_in, outs = 256, [64, 32, 32][:len(types)]
    parts = [random_blocks(t, o, n_in, seed=i) for i, (t, o) in enumerate(zip(types, outs))]
    fused = concat_outputs([codes_from_gguf(r, t, n_in) for r, t in zip(parts, types)])
    w_t = torch.cat([dense(r, t, n_in) for r, t in zip(parts, types)]).T.contiguous()
    assert torch.equal(fused.dequantize(), w_t)
    for rows in (1, 5, 12):
        x = torch.randn(rows, n_in, generator=torch.Generator().manual_seed(rows))
        assert torch.equal(blockcode_linear(x, fused), f32_linear(x, w_t))


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
