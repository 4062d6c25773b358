"""``csrc/blockcodes.c``'s wrappers: its builds, its status, and the products over block codes
(:class:`~triforce.kernels.codes.BlockCodes`).

:func:`blockcode_linear` dequantizes the codes in registers and computes bitwise what our fp32 kernel
(:func:`~triforce.kernels.cpu.f32_linear`) computes over the dequantized weights: one chain of FMAs over the inputs
per output, so a row's value does not depend on the rows beside it. :func:`blockcode_linear_q8` is llama.cpp's integer
dot product (``ggml-quants.c``) on int8 activations, row-invariant and bitwise alike on every build.
:func:`blockcode_matmul` multiplies dequantized tiles for any number of rows (prefill). ``TRIFORCE_BLOCK_CODES=0``
turns the kernel off.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .cpu import (
    _I,
    _P,
    BLOCKCODES_CFLAGS,
    BLOCKCODES_ENV_SWITCH,
    LINEAR_MAX_ROWS,
    PORTABLE_CFLAGS,
    _Library,
    best_build,
    forced_build,
)

if TYPE_CHECKING:
    from .codes import BlockCodes

#: inputs per block (ggml's QK4_1 = QK8_0 = 32; the activations' blocks of :func:`blockcode_linear_q8`)
GROUP = 32
#: floats per row and block of 32 inputs in :func:`blockcode_linear_q8`'s work beside the quantized activations: the
#: block's scale and the inputs' sums of its scale groups (two for groups of 16)
Q8_WORK_FLOATS = 3

#: flags added to a block-code width in the kernel's ``bits`` argument (``BlockCodes.kernel_bits``): fp32 scales and
#: minima (a K-quant's products), groups of 16 inputs (Q6_K's), bf16 weights (width 16), a K-quant's scales and minima
#: as stored (int8 per group, fp16 per super-block; 256 is kernels/decode_step.py's ``Q8_ACTIVATIONS``)
BC_F32, BC_G16, BC_BF16, BC_KS = 32, 64, 128, 512

#: the builds of csrc/blockcodes.c: the CPU features each needs and its flags (the AVX-512 path of the exact product,
#: 16 outputs a vector; the AVX2 one, 8; the portable one, plain C for a CPU with neither, bitwise the portable
#: ``f32_linear``)
_BUILDS = {"AVX-512 VNNI": (("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
                            BLOCKCODES_CFLAGS + ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni")),
           "AVX-512": (("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl"),
                       BLOCKCODES_CFLAGS + ("-mavx512f", "-mavx512bw", "-mavx512vl")),
           "AVX2": (("avx2", "fma", "f16c"), BLOCKCODES_CFLAGS),
           "portable": ((), PORTABLE_CFLAGS + ("-fopenmp",))}
_SYMBOLS = {"triforce_blockcode_linear": (_I, [_P, _P, _I, _P, _P, _P, _I, _I, _I, _I]),
            "triforce_blockcode_dequantize": (_I, [_P, _I, _P, _P, _P, _I, _I, _I, _I, _I]),
            "triforce_blockcode_linear_q8": (_I, [_P, _P, _I, _P, _P, _P, _I, _I, _I, _I, _P]),
            "triforce_blockcode_fit": (_I, [_P, _I, _I, _I, _P, _P, _P])}


def blockcodes_build(isa: str) -> _Library:
    """The block-code kernels built for ``isa`` (:func:`~triforce.kernels.cpu.forced_build`), to swap in as
    ``blockcodes._blockcodes`` (tests run every build this CPU can).

    Args:
        isa: "AVX-512 VNNI", "AVX-512", "AVX2" or "portable".

    Raises:
        ValueError: for another ``isa``.
    """
    return forced_build(_BUILDS, isa, "blockcodes.c", BLOCKCODES_ENV_SWITCH, _SYMBOLS)


_blockcodes = _Library("blockcodes.c", BLOCKCODES_ENV_SWITCH, (), lambda: best_build(_BUILDS),
                       _SYMBOLS, _BUILDS)


def blockcodes_status() -> str:
    """'on (...)', 'off (...)' or 'unavailable: <reason>' for the block-code kernel (loads it if nobody has yet)."""
    _blockcodes.load()
    return _blockcodes.status


def blockcode_linear(x: torch.Tensor, codes: BlockCodes) -> torch.Tensor | None:
    """``y = x W`` for the fp32 weights W that ``codes`` stand for, or None where the kernel does not apply.

    Bitwise :func:`~triforce.kernels.cpu.f32_linear` over ``codes.dequantize()`` (one chain of FMAs over the inputs
    per output), so a row's result does not depend on the rows beside it.

    Args:
        x: (M, in) fp32 contiguous CPU activations, 1 <= M <= :data:`~triforce.kernels.cpu.LINEAR_MAX_ROWS`.
        codes: the weights (:class:`~triforce.kernels.codes.BlockCodes`).

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
    rc = fns[symbol](x.data_ptr(), codes.codes.data_ptr(), codes.kernel_bits,
                     None if codes.d is None else codes.d.data_ptr(),
                     None if codes.m is None else codes.m.data_ptr(), y.data_ptr(), x.shape[0], codes.in_features,
                     codes.out_features, torch.get_num_threads(), *extra)
    return y if rc == 0 else None


def blockcode_linear_q8(x: torch.Tensor, codes: BlockCodes) -> torch.Tensor | None:
    """``y ~= x W`` with ``x`` quantized to int8 per block of 32 inputs, integer dot products over the codes: the
    file's own arithmetic (the ``file`` precision, :mod:`triforce.model.precision`) and the lower tiers' ``codes``.

    What llama.cpp computes for Q4_1 and Q8_0 weights (``ggml-quants.c``: ``vec_dot_q4_1_q8_1``, ``vec_dot_q8_0_q8_0``;
    for Q4_K, Q5_K and Q6_K, ``vec_dot_q*_K_q8_K`` sums each 32- or 16-input sub-block the same way, with activations
    quantized per 256 inputs where we quantize per 32):
    per block b of 32 inputs, ``dx_b = max |x_i| / 127``, ``xq_i = round(x_i / dx_b)`` (to nearest even), and
    ``y_o = sum_g (sum_i q_io xq_i) (d_go dx_b) + m_go sum_i x_i`` over the scale groups g (32 inputs, or 16: Q6_K) in
    order, each term a multiply and an add (the minima's term over the exact fp32 inputs). Each row's value depends on
    that row alone and is bitwise the same on the AVX-512 (VNNI or not), AVX2 and portable builds. Not the fp32
    product of the dequantized weights (relative error about 1e-2 per output).

    Args:
        x: (M, in) fp32 contiguous CPU activations, 1 <= M <= :data:`~triforce.kernels.cpu.LINEAR_MAX_ROWS`.
        codes: the weights (:class:`~triforce.kernels.codes.BlockCodes`).

    Returns:
        (M, out) fp32, or None (other dtypes, devices or shapes; more rows; codes the kernel does not take,
        :attr:`~triforce.kernels.codes.BlockCodes.q8_dot_ok`; the kernel unavailable).
    """
    if not codes.q8_dot_ok or x.dim() != 2:
        return None
    work = torch.empty(x.numel() * codes.bits + Q8_WORK_FLOATS * 4 * x.shape[0] * (x.shape[1] // GROUP) + 32,
                       dtype=torch.uint8)
    base = work.data_ptr() + (-work.data_ptr()) % 32  # the kernel's aligned loads
    return _product("triforce_blockcode_linear_q8", x, codes, base)


#: outputs of one dequantized tile in :func:`blockcode_matmul` (a multiple of 8): 8 MiB of fp32 weights for 1,024
#: inputs
MATMUL_TILE_OUTPUTS = 2048


def blockcode_matmul(x: torch.Tensor, codes: BlockCodes) -> torch.Tensor:
    """``y = x W`` for any number of rows (prefill): W's columns dequantized a tile at a time
    (:meth:`~triforce.kernels.codes.BlockCodes.dequantize`, exactly the weights the codes stand for) and multiplied by
    PyTorch's GEMM, so no fp32 copy of the matrix is kept.

    Args:
        x: (M, in) activations on the CPU (any float dtype; computed in fp32).
        codes: the weights.

    Returns:
        (M, out) fp32.
    """
    x = x.float()
    y = torch.empty(x.shape[0], codes.out_features)
    step = MATMUL_TILE_OUTPUTS // 8
    for c in range(0, codes.out_features // 8, step):
        c_to = min(c + step, codes.out_features // 8)
        y[:, 8 * c:8 * c_to] = x @ codes.dequantize(c, c_to)
    return y
