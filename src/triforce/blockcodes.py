"""Exact block codes: a GGUF model's fp32 weights kept as their 4- or 8-bit block codes, multiplied in fp32.

A model read from a GGUF file holds fp32 weights that are exactly the dequantized blocks of the file: for ggml's
Q4_1 format ``w = fl(fl(d * q) + m)`` per block of 32 inputs with a 4-bit code ``q`` in [0, 15] and the block's fp16
scale ``d`` and minimum ``m``; for Q8_0 ``w = fl(d * q)`` with ``q`` in [-128, 127] (ggml's block formats,
llama.cpp ``ggml-quants.c``; gguf-py's ``dequantize``, which transformers' GGUF reader calls). The embedded default
model (SmolLM2-135M-Instruct, Q4_1 with a Q8_0 embedding) is such a model. :func:`find_block_codes` recovers the
codes from the fp32 weights and checks that every weight is reproduced exactly; ``csrc/blockcodes.c`` then
dequantizes them in registers and computes what the fp32 weights compute, bitwise as our fp32 kernel
(``kernels.f32_linear``) does over them, while reading 0.625 (4-bit) or 1.0625 (8-bit) bytes per weight instead of 4
(the codes, and the blocks' fp16 scales and minima as the file stores them).
A decode step of the verifier is bound by those bytes, and the verifier alone defines the output distribution, so
this changes no token, only the time (the lossless rule of TriForce, arXiv 2404.11912, Sec. 4, holds as with fp32
weights; tests/test_blockcodes.py checks the products bitwise and greedy equality).

Weights from other sources (bf16 or fp32 checkpoints, GGUF k-quants) are not block codes of these two formats:
the check fails on the first blocks and they stay fp32 only. ``TRIFORCE_BLOCK_CODES=0`` turns the codes off.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from .kernels import _I, _P, BLOCKCODES_CFLAGS, BLOCKCODES_ENV_SWITCH, LINEAR_MAX_ROWS, _Library, best_build, forced_build

#: inputs per block (ggml's QK4_1 = QK8_0 = 32)
GROUP = 32
#: blocks checked before the whole matrix (the first inputs of the first 32 outputs): a matrix that is not block
#: codes costs one small check
_PROBE_BLOCKS = 32

#: the builds of csrc/blockcodes.c: the CPU features each needs and its flags (the AVX-512 path of the exact product,
#: 16 outputs a vector; the AVX2 one, 8)
_BUILDS = {"AVX-512 VNNI": (("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
                            BLOCKCODES_CFLAGS + ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni")),
           "AVX-512": (("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl"),
                       BLOCKCODES_CFLAGS + ("-mavx512f", "-mavx512bw", "-mavx512vl")),
           "AVX2": (("avx2", "fma", "f16c"), BLOCKCODES_CFLAGS)}
_SYMBOLS = {"triforce_blockcode_linear": (_I, [_P, _P, _I, _P, _P, _P, _I, _I, _I, _I]),
            "triforce_blockcode_linear_q8": (_I, [_P, _P, _I, _P, _P, _P, _I, _I, _I, _I, _P]),
            "triforce_blockcode_fit": (_I, [_P, _I, _I, _I, _P, _P, _P])}


def blockcodes_build(isa: str) -> _Library:
    """The block-code kernels built for ``isa`` (:func:`~triforce.kernels.forced_build`): tests swap the AVX2 and
    AVX-512 builds of ``csrc/blockcodes.c`` in as ``blockcodes._blockcodes`` on a machine with VNNI.

    Args:
        isa: "AVX-512 VNNI", "AVX-512" or "AVX2".

    Raises:
        ValueError: for another ``isa``.
    """
    return forced_build(_BUILDS, isa, "blockcodes.c", BLOCKCODES_ENV_SWITCH, _SYMBOLS)


_blockcodes = _Library("blockcodes.c", BLOCKCODES_ENV_SWITCH, _BUILDS["AVX2"][0], lambda: best_build(_BUILDS),
                       _SYMBOLS)


def blockcodes_status() -> str:
    """'on (...)', 'off (...)' or 'unavailable: <reason>' for the block-code kernel (loads it if nobody has yet)."""
    _blockcodes.load()
    return _blockcodes.status


@dataclass
class BlockCodes:
    """One (in, out) weight matrix as block codes, in the layout of ``csrc/blockcodes.c``.

    Attributes:
        bits: 4 (Q4_1: ``w = d * q + m``) or 8 (Q8_0: ``w = d * q``).
        codes: bits 4: (out / 8, in) int32, nibble k the code of output 8c + k; bits 8: (out / 8, in, 8) int8.
        d: (out / 8, in / 32, 8) fp16 scales per block of 32 inputs (as GGUF stores them; the kernel converts them to
            fp32 exactly); m: the same shape, the fp16 minima (bits 4), or None.
        in_features, out_features: the matrix's shape, (in, out).
    """

    bits: int
    codes: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None
    in_features: int
    out_features: int

    @cached_property
    def q8_dot_ok(self) -> bool:
        """Whether :func:`blockcode_linear_q8` takes these codes: 4-bit codes, or 8-bit codes within [-127, 127] (the
        kernel's ``vpsignb`` cannot negate -128; ggml's own Q8_0 quantization never writes it). Checked once."""
        return self.bits == 4 or int(self.codes.min()) > -128

    @property
    def nbytes(self) -> int:
        """Bytes a product reads: codes, scales and minima."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.d, self.m) if t is not None)

    def dequantize(self) -> torch.Tensor:
        """The (in, out) fp32 weights the codes stand for, computed as the check in :func:`find_block_codes` does."""
        n_in, n_out = self.in_features, self.out_features
        if self.bits == 4:
            shifts = 4 * torch.arange(8, dtype=torch.int64)
            q = ((self.codes.to(torch.int64)[..., None] & 0xFFFFFFFF) >> shifts) & 15  # (out/8, in, 8)
        else:
            q = self.codes.to(torch.int64)
        d = self.d.float().repeat_interleave(GROUP, dim=1)  # (out/8, in, 8)
        w = d * q.float()
        if self.m is not None:
            w = w + self.m.float().repeat_interleave(GROUP, dim=1)
        return w.permute(1, 0, 2).reshape(n_in, n_out)


def find_block_codes(weight_t: torch.Tensor) -> BlockCodes | None:
    """The exact Q4_1 or Q8_0 block codes of an (in, out) fp32 weight matrix, or None where it has none.

    ``csrc/blockcodes.c`` (``triforce_blockcode_fit``, one pass over the matrix) takes each block's scale as
    (max - min) / 15 (Q4_1) or max |w| / 127 (Q8_0) rounded to fp16, or an fp16 value up to 2 steps from it, and checks
    that every weight's ``d * q + m`` (two roundings, as the product kernel computes it) equals the weight, with the
    block's minimum ``m`` an fp16 value (a Q4_1 block's code 0 is its fp16 minimum); one block
    that no candidate reproduces makes the answer None (a matrix that is not block codes fails on its first
    :data:`_PROBE_BLOCKS` blocks, at little cost).

    Args:
        weight_t: (in, out) fp32 on the CPU (a :class:`~triforce.model.Linear`'s ``weight_t``), in and out multiples
            of 32 (ggml's blocks; the kernel's 4 column blocks of 8).

    Returns:
        :class:`BlockCodes`, or None (another dtype, device or shape, weights that are not block codes, or the
        kernel unavailable: ``blockcodes_status()`` says why).
    """
    if (weight_t.dtype != torch.float32 or weight_t.device.type != "cpu" or weight_t.dim() != 2
            or weight_t.shape[0] % GROUP or weight_t.shape[1] % 32 or weight_t.numel() == 0):
        return None
    fns = _blockcodes.load()
    if fns is None:
        return None
    w = weight_t.detach().contiguous()
    probe = w[:GROUP, :_PROBE_BLOCKS].contiguous()
    for bits in (4, 8):
        if _fit(fns, probe, bits) is not None:
            codes = _fit(fns, w, bits)
            if codes is not None:
                return codes
    return None


def _fit(fns: dict, w: torch.Tensor, bits: int) -> BlockCodes | None:
    """``triforce_blockcode_fit`` over a contiguous (in, out) fp32 matrix: its codes, or None."""
    n_in, n_out = w.shape
    codes = (torch.empty(n_out // 8, n_in, dtype=torch.int32) if bits == 4
             else torch.empty(n_out // 8, n_in, 8, dtype=torch.int8))
    d = torch.empty(n_out // 8, n_in // GROUP, 8, dtype=torch.float16)
    m = torch.empty_like(d) if bits == 4 else None
    rc = fns["triforce_blockcode_fit"](w.data_ptr(), n_in, n_out, bits, codes.data_ptr(), d.data_ptr(),
                                       None if m is None else m.data_ptr())
    return BlockCodes(bits, codes, d, m, n_in, n_out) if rc == 0 else None


def blockcode_linear(x: torch.Tensor, codes: BlockCodes) -> torch.Tensor | None:
    """``y = x W`` for the fp32 weights W that ``codes`` stand for, or None where the kernel does not apply.

    Bitwise the product :func:`~triforce.kernels.f32_linear` computes over ``codes.dequantize()`` (one chain of FMAs
    over the inputs per output), so a row's result does not depend on the rows beside it.

    Args:
        x: (M, in) fp32 contiguous CPU activations, 1 <= M <= :data:`~triforce.kernels.LINEAR_MAX_ROWS`.
        codes: the weights (:class:`BlockCodes`).

    Returns:
        (M, out) fp32, or None (other dtypes, devices or shapes; more rows; the kernel unavailable).
    """
    return _product("triforce_blockcode_linear", x, codes)


def _product(symbol: str, x: torch.Tensor, codes: BlockCodes, *extra) -> torch.Tensor | None:
    """Call the kernel ``symbol`` for ``y = x W`` (None where its preconditions or the kernel do not hold)."""
    if (x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[1] != codes.in_features
            or not 1 <= x.shape[0] <= LINEAR_MAX_ROWS):
        return None
    fns = _blockcodes.load()
    if fns is None:
        return None
    x = x.contiguous()
    y = torch.empty(x.shape[0], codes.out_features)
    rc = fns[symbol](x.data_ptr(), codes.codes.data_ptr(), codes.bits, codes.d.data_ptr(),
                     None if codes.m is None else codes.m.data_ptr(), y.data_ptr(), x.shape[0], codes.in_features,
                     codes.out_features, torch.get_num_threads(), *extra)
    return y if rc == 0 else None


def blockcode_linear_q8(x: torch.Tensor, codes: BlockCodes) -> torch.Tensor | None:
    """``y ~= x W`` with ``x`` quantized to int8 per block of 32 inputs, integer dot products over the codes.

    What llama.cpp computes for Q4_1 and Q8_0 weights (``ggml-quants.c``: ``vec_dot_q4_1_q8_1``, ``vec_dot_q8_0_q8_0``):
    per block g of 32 inputs, ``dx_g = max |x_i| / 127``, ``xq_i = round(x_i / dx_g)``, and
    ``y_o = sum_g d_go dx_g sum_i q_io xq_i + m_go sum_i x_i`` (the minima's term over the exact fp32 inputs). Not the
    fp32 product (relative error about 1e-2 per output): for tiers below the verifier only, whose rounding changes how
    often their proposals are accepted, never the output (TriForce, arXiv 2404.11912, Sec. 4). About a quarter of
    the exact kernel's instructions per weight, so a one-row product runs at the codes' memory bandwidth
    (``bench/blockcodes.py --q8``).

    Args:
        x: (M, in) fp32 contiguous CPU activations, 1 <= M <= :data:`~triforce.kernels.LINEAR_MAX_ROWS`.
        codes: the weights (:class:`BlockCodes`).

    Returns:
        (M, out) fp32, or None (other dtypes, devices or shapes; more rows; codes the kernel does not take,
        :attr:`BlockCodes.q8_dot_ok`; the kernel unavailable).
    """
    if not codes.q8_dot_ok or x.dim() != 2:
        return None
    work = torch.empty(x.numel() * codes.bits + 8 * x.shape[0] * (x.shape[1] // GROUP) + 32, dtype=torch.uint8)
    base = work.data_ptr() + (-work.data_ptr()) % 32  # the kernel's aligned loads
    return _product("triforce_blockcode_linear_q8", x, codes, base)
