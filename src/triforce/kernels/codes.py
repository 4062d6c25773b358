"""Block codes: a matrix kept as a file stores it (``csrc/blockcodes.c``'s layout), and its recovery from fp32 weights.

A model read from a GGUF file holds fp32 weights that are exactly the dequantized blocks of the file: for ggml's
Q4_1 format ``w = fl(fl(d * q) + m)`` per block of 32 inputs with a 4-bit code ``q`` in [0, 15] and the block's fp16
scale ``d`` and minimum ``m``; for Q8_0 ``w = fl(d * q)`` with ``q`` in [-128, 127] (ggml's block formats,
llama.cpp ``ggml-quants.c``; gguf-py's ``dequantize``, which transformers' GGUF reader calls). :func:`find_block_codes`
recovers the codes from the fp32 weights and checks that every weight is reproduced exactly; the products
(:mod:`triforce.kernels.blockcodes`) then read 0.625 (4-bit) or 1.0625 (8-bit) bytes per weight instead of 4 for the
same fp32 result, so the output distribution is unchanged (TriForce's lossless rule, arXiv 2404.11912, Sec. 4).

A GGUF file read as stored (``formats/ggufcodes.py``: Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K) gives
:class:`BlockCodes` directly: K-quants keep an int8 group scale per 32 inputs (16: Q6_K's, ``BC_G16``) and an fp16
super-block scale per 256 (``BC_KS``), whose exact fp32 product the kernel forms; a fusion of K-quants with the
fp16-scale types keeps those products as fp32 (``BC_F32``). A bf16 or fp16 checkpoint's matrices stay at 2 bytes a
weight (:func:`codes_from_16bit`, width 16: the weights themselves, widened exactly). fp32 checkpoints are not block
codes: the check fails on the first blocks and they stay fp32.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from . import blockcodes
from .blockcodes import BC_BF16, BC_F32, BC_G16, BC_KS, GROUP

#: blocks checked before the whole matrix (the first inputs of the first 32 outputs): a matrix that is not block
#: codes costs one small check
_PROBE_BLOCKS = 32

#: inputs per K-quant super-block (ggml's QK_K)
SUPER = 256
#: the 2-byte weight dtypes kept as they are stored (width 16)
WIDTH16_DTYPES = (torch.bfloat16, torch.float16)


@dataclass
class BlockCodes:
    """One (in, out) weight matrix as block codes, in the layout of ``csrc/blockcodes.c``: ``w = fl(d q) + m`` per
    group of ``group`` inputs and output, with ``d q`` exact in fp32; or (width 16) the 2-byte weights themselves.

    Attributes:
        bits: 4 (codes in [0, 15], nibbles), 8 (codes in [-128, 127], int8) or 16 (bf16 or fp16 weights).
        codes: bits 4: (out / 8, in) int32, nibble k the code of output 8c + k; bits 8: (out / 8, in, 8) int8;
            bits 16: (out / 8, in, 8) bf16 or fp16, the weight of output 8c + k at input i.
        d: (out / 8, in / group, 8) scales per group of inputs: fp16 as GGUF's Q4_0/Q4_1/Q5_0/Q8_0 store them; int8
            (a K-quant's 6- or 8-bit group scale sc, with ``d_super``); or fp32 (the exact product of the two, where a
            K-quant is fused with an fp16-scale type); None for bits 16. m: the same shape and dtype, the minima
            (None: ``w = d q``).
        in_features, out_features: the matrix's shape, (in, out).
        group: inputs per scale, 32 or 16 (Q6_K).
        d_super, m_super: a K-quant's fp16 super-block scale d and negated minimum -dmin, (out / 8, in / 256, 8),
            or None: the scale of a group is ``d_super sc`` and its minimum ``m_super mc`` (exact in fp32: an fp16
            times an integer below 2^7 in magnitude), bitwise the fp32 values gguf-py computes. Each is kept in one
            buffer right after ``d`` (``m``): the kernel finds it at byte ``d.numel()`` (:meth:`__post_init__`).
    """

    bits: int
    codes: torch.Tensor
    d: torch.Tensor | None
    m: torch.Tensor | None
    in_features: int
    out_features: int
    group: int = GROUP
    d_super: torch.Tensor | None = None
    m_super: torch.Tensor | None = None

    def __post_init__(self) -> None:
        """A K-quant's (int8, fp16) pairs packed into one buffer each, the fp16 values right after the int8 ones (the
        kernel's ``BC_KS`` layout: one pointer a pair).

        Raises:
            ValueError: super-block values without int8 group values (or the reverse), or shapes that do not match.
        """
        if (self.d_super is None) != (self.d is None or self.d.dtype != torch.int8) or (
                (self.m_super is None) != (self.m is None or self.m.dtype != torch.int8)):
            raise ValueError("BlockCodes: int8 group scales (minima) go with fp16 super-block ones, and only they")
        if self.d_super is None:
            return
        want = (self.out_features // 8, self.in_features // SUPER, 8)
        for sub, sup in ((self.d, self.d_super), (self.m, self.m_super)):
            if sup is not None and (tuple(sup.shape) != want or sup.dtype != torch.float16
                                    or self.in_features % SUPER or sub.shape[0] != want[0]):
                raise ValueError(f"BlockCodes: super-block values must be fp16 {want} (in a multiple of {SUPER})")
        self.d, self.d_super = _packed(self.d, self.d_super)
        if self.m is not None:
            self.m, self.m_super = _packed(self.m, self.m_super)

    @property
    def kernel_bits(self) -> int:
        """The ``bits`` argument of the kernels: the width plus :data:`BC_F32`, :data:`BC_G16` and :data:`BC_BF16` as
        they apply."""
        if self.bits == 16:
            return 16 | (BC_BF16 if self.codes.dtype == torch.bfloat16 else 0)
        return (self.bits | (BC_F32 if self.d.dtype == torch.float32 else 0)
                | (BC_KS if self.d_super is not None else 0) | (BC_G16 if self.group == 16 else 0))

    @cached_property
    def q8_dot_ok(self) -> bool:
        """Whether :func:`~triforce.kernels.blockcodes.blockcode_linear_q8` takes these codes: fp16 (Q4_0, Q4_1, Q5_0,
        Q8_0), stored K-quant (Q4_K, Q5_K, Q6_K and their fusions) or fp32 scales, with 4-bit codes or 8-bit codes
        within [-127, 127] (the kernel's ``vpsignb`` cannot negate -128; ggml's own Q8_0 quantization never writes
        it); groups of 16 (Q6_K's) with 8-bit codes and K-quant or fp32 scales. 2-byte weights are not taken. Checked
        once."""
        if self.kernel_bits not in (4, 8, 4 | BC_F32, 8 | BC_F32, 4 | BC_KS, 8 | BC_KS, 8 | BC_KS | BC_G16,
                                    8 | BC_F32 | BC_G16):
            return False
        return self.bits == 4 or int(self.codes.min()) > -128

    @property
    def nbytes(self) -> int:
        """Bytes a product reads: codes, scales and minima (a K-quant's group and super-block values)."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.d, self.m, self.d_super, self.m_super)
                   if t is not None)

    def group_scales(self, c_from: int = 0, c_to: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The scales and minima of column blocks [c_from, c_to) as (C, in / group, 8) fp32: a K-quant's ``d_super sc``
        and ``m_super mc`` (exact), or the stored values widened."""
        def full(sub: torch.Tensor | None, sup: torch.Tensor | None) -> torch.Tensor | None:
            if sub is None:
                return None
            if sup is None:
                return sub[c_from:c_to].float()
            return sup[c_from:c_to].float().repeat_interleave(SUPER // self.group, dim=1) * sub[c_from:c_to].float()
        return full(self.d, self.d_super), full(self.m, self.m_super)

    def unpacked(self) -> torch.Tensor:
        """The codes as (out / 8, in, 8) int8 (4-bit codes unpacked; 8-bit codes as they are).

        Raises:
            ValueError: 2-byte weights (bits 16), which are not codes.
        """
        if self.bits == 16:
            raise ValueError("BlockCodes.unpacked: 2-byte weights (bits 16) have no codes")
        if self.bits == 8:
            return self.codes
        shifts = 4 * torch.arange(8, dtype=torch.int32)
        return ((self.codes[..., None] >> shifts) & 15).to(torch.int8)

    def dequantize(self, c_from: int = 0, c_to: int | None = None) -> torch.Tensor:
        """The (in, out) fp32 weights the codes stand for (``fl(fl(d q) + m)``), or those of column blocks
        [c_from, c_to) (outputs 8 c_from .. 8 c_to - 1) as an (in, 8 (c_to - c_from)) tile: csrc/blockcodes.c's
        ``triforce_blockcode_dequantize`` where the kernel loads, else the same arithmetic in PyTorch."""
        c_to = self.out_features // 8 if c_to is None else c_to
        fns = blockcodes._blockcodes.load()
        if fns is not None:
            w = torch.empty(self.in_features, 8 * (c_to - c_from))
            rc = fns["triforce_blockcode_dequantize"](self.codes.data_ptr(), self.kernel_bits,
                                                      None if self.d is None else self.d.data_ptr(),
                                                      None if self.m is None else self.m.data_ptr(), w.data_ptr(),
                                                      self.in_features, self.out_features, c_from, c_to,
                                                      torch.get_num_threads())
            if rc == 0:
                return w
        if self.bits == 16:
            return self.codes[c_from:c_to].float().permute(1, 0, 2).reshape(self.in_features, -1)
        q = self.unpacked()[c_from:c_to].float()  # (C, in, 8)
        d, m = self.group_scales(c_from, c_to)
        w = d.repeat_interleave(self.group, dim=1) * q
        if m is not None:
            w = w + m.repeat_interleave(self.group, dim=1)
        return w.permute(1, 0, 2).reshape(self.in_features, -1)

    def promoted(self, bits: int, f32: bool, group: int, has_m: bool) -> "BlockCodes":
        """The same weights in a wider format (8-bit codes, fp32 scales, groups of 16, minima of 0), so that matrices
        of different GGUF types can share one product (q, k and v; gate and up). Exact: fp16 scales are fp32 values,
        a K-quant's ``d_super sc`` is exact in fp32, a group's scale serves both its halves, and ``fl(d q) + 0`` is
        ``d q`` (a zero weight's sign aside, which no FMA chain starting at +0 can see). A K-quant's stored scales stay
        stored unless ``f32``."""
        codes = self.codes if bits == self.bits else self.unpacked()
        d, m, d_super, m_super = self.d, self.m, self.d_super, self.m_super
        if f32 and d_super is not None:
            (d, m), d_super, m_super = self.group_scales(), None, None
        if has_m and m is None:
            m = torch.zeros_like(d)
            m_super = None if d_super is None else torch.zeros_like(d_super)
        if f32:
            d, m = d.float(), None if m is None else m.float()
        if group != self.group:
            d, m = d.repeat_interleave(2, dim=1), None if m is None else m.repeat_interleave(2, dim=1)
        return BlockCodes(bits, codes, d.contiguous(), None if m is None else m.contiguous(), self.in_features,
                          self.out_features, group, d_super, m_super)


def concat_outputs(parts: list[BlockCodes]) -> BlockCodes:
    """Matrices of the same inputs side by side along their outputs (q, k, v as one qkv product), each first
    :meth:`~BlockCodes.promoted` to the narrowest format that holds them all.

    Raises:
        ValueError: parts of different input sizes, or 2-byte weights (bits 16) beside other formats or dtypes.
    """
    if len({p.in_features for p in parts}) != 1:
        raise ValueError(f"concat_outputs: input sizes differ: {[p.in_features for p in parts]}")
    if any(p.bits == 16 for p in parts):
        if len({(p.bits, p.codes.dtype) for p in parts}) != 1:
            raise ValueError("concat_outputs: 2-byte weights (bits 16) join only 2-byte weights of the same dtype")
        return BlockCodes(16, torch.cat([p.codes for p in parts]), None, None, parts[0].in_features,
                          sum(p.out_features for p in parts))
    bits, group, has_m = max(p.bits for p in parts), min(p.group for p in parts), any(p.m is not None for p in parts)
    ks = all(p.d_super is not None for p in parts)  # K-quants only: their stored scales, fused as they are
    f32 = not ks and any(p.d.dtype == torch.float32 or p.d_super is not None for p in parts)
    if ks and group == 32:  # the kernel's stored K-quant formats over groups of 32 have minima (Q4_K's, Q5_K's)
        has_m = True
    if (f32 or ks) and bits == 4 and not has_m:  # the fp32-scale formats: 4-bit codes with minima, or 8-bit codes
        bits = 8
    if (f32 or ks) and group == 16:
        bits = 8
    parts = [p.promoted(bits, f32, group, has_m) for p in parts]
    if len(parts) == 1:
        return parts[0]
    cat = lambda ts: torch.cat(ts, dim=0) if ts[0] is not None else None  # noqa: E731  (the column-block axis)
    return BlockCodes(bits, cat([p.codes for p in parts]), cat([p.d for p in parts]),
                      cat([p.m for p in parts]) if has_m else None, parts[0].in_features,
                      sum(p.out_features for p in parts), group, cat([p.d_super for p in parts]),
                      cat([p.m_super for p in parts]) if has_m else None)


def _packed(sub: torch.Tensor, sup: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 (C, groups, 8) array and an fp16 (C, supers, 8) one as views of one buffer, the fp16 values right after
    the int8 ones (csrc/blockcodes.c's ``BC_KS``: the kernel finds them at byte ``sub.numel()``); as they are where
    they already lie so."""
    sup_at = sub.data_ptr() + sub.numel()
    if (sub.is_contiguous() and sup.is_contiguous() and sup.data_ptr() == sup_at
            and sub.untyped_storage().data_ptr() == sup.untyped_storage().data_ptr()):
        return sub, sup
    a, b = empty_stored_scales(sub.shape[0], sub.shape[1], sup.shape[1])
    a.copy_(sub)
    b.copy_(sup)
    return a, b


def empty_stored_scales(blocks: int, groups: int, supers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised int8 (blocks, groups, 8) and fp16 (blocks, supers, 8) views of one buffer, the fp16 values right
    after the int8 ones: a K-quant's scales or minima as :class:`BlockCodes` keeps them (``BC_KS``)."""
    n = blocks * groups * 8
    buf = torch.empty(n + 2 * blocks * supers * 8, dtype=torch.uint8)
    return (buf[:n].view(torch.int8).view(blocks, groups, 8),
            buf[n:].view(torch.float16).view(blocks, supers, 8))


def codes_from_16bit(weight: torch.Tensor) -> BlockCodes | None:
    """A bf16 or fp16 checkpoint's (out, in) weight matrix kept at 2 bytes a weight, in the kernel's layout (bits 16):
    the products widen each weight exactly to fp32 in registers, so they equal :func:`~triforce.kernels.cpu.f32_linear`
    over ``weight.float().T`` bitwise, from half the bytes.

    Args:
        weight: (out, in) bf16 or fp16 on the CPU (a checkpoint's ``*_proj.weight``, ``lm_head.weight``), in and out
            multiples of 32.

    Returns:
        :class:`BlockCodes` with ``codes`` (out / 8, in, 8) of ``weight``'s dtype, or None (another dtype, device or
        shape, or the kernel unavailable: ``blockcodes_status()`` says why).
    """
    if (weight.dtype not in WIDTH16_DTYPES or weight.device.type != "cpu" or weight.dim() != 2
            or weight.shape[0] % 32 or weight.shape[1] % GROUP or weight.numel() == 0
            or blockcodes._blockcodes.load() is None):
        return None
    n_out, n_in = weight.shape
    codes = weight.detach().reshape(n_out // 8, 8, n_in).transpose(1, 2).contiguous()  # (out / 8, in, 8)
    return BlockCodes(16, codes, None, None, n_in, n_out)


def find_block_codes(weight_t: torch.Tensor) -> BlockCodes | None:
    """The exact Q4_1 or Q8_0 block codes of an (in, out) fp32 weight matrix, or None where it has none.

    ``csrc/blockcodes.c`` (``triforce_blockcode_fit``, one pass over the matrix) takes each block's scale as
    (max - min) / 15 (Q4_1) or max |w| / 127 (Q8_0) rounded to fp16, or an fp16 value up to 2 steps from it, and checks
    that every weight's ``d * q + m`` (two roundings, as the product kernel computes it) equals the weight, with the
    block's minimum ``m`` an fp16 value (a Q4_1 block's code 0 is its fp16 minimum); one block
    that no candidate reproduces makes the answer None (a matrix that is not block codes fails on its first
    :data:`_PROBE_BLOCKS` blocks, at little cost).

    Args:
        weight_t: (in, out) fp32 on the CPU (a :class:`~triforce.model.transformer.Linear`'s ``weight_t``), in and out
            multiples of 32 (ggml's blocks; the kernel's 4 column blocks of 8).

    Returns:
        :class:`BlockCodes`, or None (another dtype, device or shape, weights that are not block codes, or the
        kernel unavailable: ``blockcodes_status()`` says why).
    """
    if (weight_t.dtype != torch.float32 or weight_t.device.type != "cpu" or weight_t.dim() != 2
            or weight_t.shape[0] % GROUP or weight_t.shape[1] % 32 or weight_t.numel() == 0):
        return None
    fns = blockcodes._blockcodes.load()
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
