"""A GGUF file's weights as the file stores them: block codes for the products, raw rows for the token embedding.

ggml's block formats (llama.cpp ``ggml-quants.c``; gguf-py's ``dequantize``, which transformers' GGUF reader calls)
define every weight as ``w = fl(d q) + m`` for a group of 32 (16 for Q6_K) inputs of one output, with ``d q`` exact in
fp32:

====== ===================================================== ===============================================
type   per block (bytes a weight in the file)                 as :class:`~triforce.kernels.codes.BlockCodes`
                                                              (bytes a weight)
====== ===================================================== ===============================================
Q4_0   fp16 d, 4-bit q: ``d (q - 8)`` (0.5625)                 4-bit codes, fp16 d, m = -8 d (fp16, exact) (0.625)
Q4_1   fp16 d, m, 4-bit q: ``d q + m`` (0.625)                 4-bit codes, fp16 d, m (0.625)
Q5_0   fp16 d, 5-bit q: ``d (q - 16)`` (0.6875)                8-bit codes, fp16 d (1.0625)
Q8_0   fp16 d, int8 q: ``d q`` (1.0625)                        8-bit codes, fp16 d (1.0625)
Q4_K   fp16 d, dmin per 256; 6-bit sc, mc per 32; 4-bit q:     4-bit codes; int8 sc, mc per 32; fp16 d, -dmin per 256
       ``(d sc) q - dmin mc`` (0.5625)                         (0.578)
Q5_K   as Q4_K with 5-bit q (0.6875)                           8-bit codes, scales as Q4_K's (1.078)
Q6_K   fp16 d per 256, int8 sc per 16, 6-bit q:                8-bit codes; int8 sc per 16, fp16 d per 256
       ``(d sc) (q - 32)`` (0.8203)                            (1.070)
====== ===================================================== ===============================================

A K-quant's scales are kept as the file keeps them in spirit (``BC_KS``: the 6-bit or int8 group values widened to
int8, the fp16 super-block values as they are, -dmin for the minima), and the kernel forms ``d sc`` and
``(-dmin) mc`` in fp32 in registers. The products d sc, dmin mc (an fp16 times an integer below 2^8) and d q are exact
in fp32, so each weight is the one rounding of ``d q + m`` that gguf-py's numpy computes (``tests/test_ggufcodes.py``
checks every type bitwise against ``gguf.quants.dequantize``, and the stored scales' products against gguf-py's fp32
ones). The verifier then multiplies by exactly the file's dequantized weights (csrc/blockcodes.c) while reading its
codes: the model is the same, only the bytes a decode step reads change (TriForce's lossless rule, arXiv 2404.11912,
Sec. 4, holds as with fp32 weights).
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader
from gguf.quants import dequantize as gguf_dequantize

from ..kernels.codes import SUPER, BlockCodes, empty_stored_scales
from ..kernels.stored import StoredRows

#: the GGUF types read as block codes; others (F32, F16, BF16, the rest) are dequantized to fp32 tensors
CODED_TYPES = (QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q8_0, QT.Q4_K, QT.Q5_K, QT.Q6_K)
#: rows converted at a time (a multiple of 8): bounds the conversion's temporaries for a large vocabulary
_ROWS_PER_PASS = 8192


def _nibbles(qs: np.ndarray, span: int) -> np.ndarray:
    """ggml's nibble order: within each ``span`` bytes, the low nibbles are elements 0 .. span-1 and the high ones
    span .. 2 span - 1. qs: (rows, n, span) uint8 -> (rows, n, 2 span) uint8."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of 6-bit scales and minima -> (..., 8) each (gguf-py ``Q4_K.get_scale_min``)."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def decode_blocks(raw: np.ndarray, qtype: QT) -> tuple[int, np.ndarray, object, object, int]:
    """One type's blocks -> ``(bits, q, d, m, group)``.

    Args:
        raw: (rows, bytes a row) uint8, each row one output's blocks as the file stores them.
        qtype: one of :data:`CODED_TYPES`.

    Returns:
        bits (4 or 8); q: (rows, in) int8 codes; d, m: (rows, in / group) fp16 scales and minima (m None for
        ``w = d q``), or for a K-quant the pairs (int8 (rows, in / group) group values, fp16 (rows, in / 256)
        super-block values) whose products are the scales (d sc) and minima ((-dmin) mc), exact in fp32; group (32 or
        16). ``w = fl(d q) + m`` is gguf-py's dequantized weight, bitwise.

    Raises:
        ValueError: a type outside :data:`CODED_TYPES`.
    """
    rows = raw.shape[0]
    if qtype in (QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q8_0):
        size = {QT.Q4_0: 18, QT.Q4_1: 20, QT.Q5_0: 22, QT.Q8_0: 34}[qtype]
        b = raw.reshape(rows, -1, size)
        d = np.ascontiguousarray(b[..., 0:2]).view(np.float16)[..., 0]
        if qtype == QT.Q8_0:
            return 8, np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(rows, -1), d, None, 32
        if qtype == QT.Q4_1:
            m = np.ascontiguousarray(b[..., 2:4]).view(np.float16)[..., 0]
            return 4, _nibbles(b[..., 4:], 16).reshape(rows, -1).astype(np.int8), d, m, 32
        if qtype == QT.Q4_0:
            q = _nibbles(b[..., 2:], 16).reshape(rows, -1)
            m = (d * np.float16(-8))  # exact in fp16 unless it overflows: then 8-bit codes d (q - 8)
            if np.isfinite(m).all():
                return 4, q.astype(np.int8), d, m, 32
            return 8, (q.astype(np.int16) - 8).astype(np.int8), d, None, 32
        qh = np.ascontiguousarray(b[..., 2:6]).view(np.uint32)[..., 0]  # Q5_0: bit j is element j's fifth bit
        high = ((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        q = (_nibbles(b[..., 6:], 16) | (high << 4)).astype(np.int16) - 16
        return 8, q.reshape(rows, -1).astype(np.int8), d, None, 32
    if qtype in (QT.Q4_K, QT.Q5_K):
        b = raw.reshape(rows, -1, 144 if qtype == QT.Q4_K else 176)
        sc, mn = _k_scale_min(b[..., 4:16])  # (rows, n, 8) in [0, 63]
        # d sc and (-dmin) mc = -(dmin mc), exact in fp32 (fp16 times an integer below 2^6): the kernel's products
        d = (sc.astype(np.int8).reshape(rows, -1), np.ascontiguousarray(b[..., 0:2]).view(np.float16)[..., 0])
        m = (mn.astype(np.int8).reshape(rows, -1), -np.ascontiguousarray(b[..., 2:4]).view(np.float16)[..., 0])
        qs = b[..., -128:].reshape(rows, -1, 4, 32)
        q = _nibbles(qs, 32).reshape(rows, -1, 8, 32)  # sub-block 2j, 2j + 1 from the j-th 32 bytes
        bits = 4
        if qtype == QT.Q5_K:
            qh = b[..., 16:48].reshape(rows, -1, 1, 32)
            q = q | (((qh >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1) << 4)
            bits = 8
        return bits, q.reshape(rows, -1).astype(np.int8), d, m, 32
    if qtype == QT.Q6_K:
        b = raw.reshape(rows, -1, 210)
        ql = b[..., 0:128].reshape(rows, -1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
        ql = (ql & 15).reshape(rows, -1, 8, 32)  # element 128 h + 64 s + t: nibble s of byte 64 h + t
        qh = b[..., 128:192].reshape(rows, -1, 2, 1, 32)
        qh = ((qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)) & 3).reshape(rows, -1, 8, 32)
        q = (ql | (qh << 4)).astype(np.int16) - 32
        d = (np.ascontiguousarray(b[..., 192:208]).view(np.int8).reshape(rows, -1),  # d sc: exact in fp32
             np.ascontiguousarray(b[..., 208:210]).view(np.float16)[..., 0])
        return 8, q.reshape(rows, -1).astype(np.int8), d, None, 16
    raise ValueError(f"decode_blocks: GGUF type {qtype!r} is not one of {[t.name for t in CODED_TYPES]}")


def codes_from_gguf(raw: np.ndarray, qtype: QT, n_in: int) -> BlockCodes:
    """A GGUF matrix of ``raw.shape[0]`` outputs and ``n_in`` inputs as :class:`~triforce.kernels.codes.BlockCodes`
    (the (in, out) layout of csrc/blockcodes.c), converted :data:`_ROWS_PER_PASS` outputs at a time.

    Args:
        raw: (out, bytes a row) uint8, each row one output's blocks (out a multiple of 32, in of 32).
        qtype: one of :data:`CODED_TYPES`.
        n_in: inputs per row.

    Raises:
        ValueError: another type, or shapes the kernel does not take.
    """
    n_out = raw.shape[0]
    if n_out % 32 or n_in % 32:
        raise ValueError(f"codes_from_gguf: a ({n_out}, {n_in}) matrix: outputs and inputs must be multiples of 32")
    codes = d_all = m_all = d_sup = m_sup = None

    def blocked(a: np.ndarray, n: int) -> torch.Tensor:  # (8 n, k) -> (n, k, 8): output 8c + j in lane j
        return torch.from_numpy(np.ascontiguousarray(a.reshape(n, 8, -1).transpose(0, 2, 1)))

    for r0 in range(0, n_out, _ROWS_PER_PASS):
        bits, q, d, m, group = decode_blocks(raw[r0:r0 + _ROWS_PER_PASS], qtype)
        c0, n = r0 // 8, q.shape[0] // 8
        stored = isinstance(d, tuple)  # a K-quant's (int8 group, fp16 super-block) values
        if codes is not None and (bits == 4) != (codes.dtype == torch.int32):
            raise ValueError("codes_from_gguf: a Q4_0 matrix whose -8 d overflows fp16 in some rows only")
        if codes is None:
            codes = (torch.empty(n_out // 8, n_in, dtype=torch.int32) if bits == 4
                     else torch.empty(n_out // 8, n_in, 8, dtype=torch.int8))
            if stored:
                d_all, d_sup = empty_stored_scales(n_out // 8, n_in // group, n_in // SUPER)
                m_all, m_sup = (None, None) if m is None else empty_stored_scales(n_out // 8, n_in // group,
                                                                                  n_in // SUPER)
            else:
                d_all = torch.empty(n_out // 8, n_in // group, 8, dtype=torch.float16)
                m_all = None if m is None else torch.empty_like(d_all)
        qb = q.reshape(n, 8, n_in).transpose(0, 2, 1)  # (n, in, 8): output 8c + k in lane k
        if bits == 4:
            packed = np.zeros((n, n_in), dtype=np.uint32)
            for k in range(8):
                packed |= qb[..., k].astype(np.uint32) << np.uint32(4 * k)
            codes[c0:c0 + n] = torch.from_numpy(packed.view(np.int32))
        else:
            codes[c0:c0 + n] = torch.from_numpy(np.ascontiguousarray(qb))
        for pair, sub, sup in ((d, d_all, d_sup), (m, m_all, m_sup)):
            if pair is None:
                continue
            if stored:
                sub[c0:c0 + n], sup[c0:c0 + n] = blocked(pair[0], n), blocked(pair[1], n)
            else:
                sub[c0:c0 + n] = blocked(pair, n)
    return BlockCodes(bits, codes, d_all, m_all, n_in, n_out, group, d_sup, m_sup)


class GGUFRows(StoredRows):
    """A GGUF matrix kept as the file's rows (a token embedding: one row read per token), dequantized on lookup.

    Attributes:
        raw: (rows, bytes a row) uint8, the file's blocks.
        qtype: its GGUF type; n_cols: values a row.
    """

    def __init__(self, raw: np.ndarray, qtype: QT, n_cols: int) -> None:
        super().__init__()
        self.raw = torch.from_numpy(np.ascontiguousarray(raw, dtype=np.uint8))
        self.qtype, self.n_cols = qtype, n_cols

    @property
    def shape(self) -> tuple[int, int]:
        """(rows, values a row), as the dense matrix's."""
        return (self.raw.shape[0], self.n_cols)

    @property
    def nbytes(self) -> int:
        """Bytes held: the file's blocks."""
        return self.raw.numel()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """(n,) int64 row ids -> (n, n_cols) fp32: gguf-py's ``dequantize`` of those rows (the same bits as the
        dense matrix's rows)."""
        raw = self.raw.index_select(0, ids.reshape(-1).cpu()).numpy()
        return torch.from_numpy(np.asarray(gguf_dequantize(raw, self.qtype), dtype=np.float32).reshape(-1, self.n_cols))


_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}


def _hf_name(name: str) -> str | None:
    """A GGUF tensor name -> its Hugging Face name (Llama/Qwen2 layout), or None for tensors the model does not use."""
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _NAMES:
        return f"model.layers.{parts[1]}.{_NAMES[parts[2]]}.{parts[3]}"
    return None


def _unpermute_rows(n_rows: int, n_heads: int) -> np.ndarray:
    """The row order that undoes llama.cpp's conversion of a Llama q/k projection (its RoPE pairs (i, i + hd/2)
    interleaved, ``convert_hf_to_gguf.py`` ``permute``; transformers' GGUF reader undoes it alike): Hugging Face row
    ``h hd + t hd/2 + j`` is the file's row ``h hd + 2 j + t``."""
    hd = n_rows // n_heads
    h, t, j = np.meshgrid(np.arange(n_heads), np.arange(2), np.arange(hd // 2), indexing="ij")
    return (h * hd + 2 * j + t).reshape(-1)


def read_gguf_codes(path, n_heads: int, n_kv_heads: int, tied: bool) -> dict[str, object]:
    """A GGUF file's tensors in Hugging Face names, without an fp32 copy of its quantized matrices.

    Args:
        path: the .gguf file.
        n_heads, n_kv_heads: attention heads (Llama's q/k rows are reordered as transformers' reader does).
        tied: the config ties the LM head to the token embedding: the head's codes are the embedding's (a file's
            ``output.weight`` is then not read, as :meth:`~triforce.model.transformer.Transformer.from_state_dict` ties
            them).

    Returns:
        name -> :class:`~triforce.kernels.codes.BlockCodes` for each projection of a type in :data:`CODED_TYPES`
        (the transposed (in, out) matrix), :class:`GGUFRows` for a coded token embedding, fp32 tensors for the rest
        (norms, biases, and matrices of other types, dequantized).

    Raises:
        ValueError: the file has no token embedding.
    """
    reader = GGUFReader(str(path))
    arch_field = reader.fields.get("general.architecture")
    arch = bytes(arch_field.parts[arch_field.data[0]]).decode() if arch_field is not None else ""
    state: dict[str, object] = {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name is None or (tied and name == "lm_head.weight"):
            continue
        n_in = int(t.shape[0])
        # read from the file, not through the reader's memory map: only this tensor is resident while it converts
        data = np.fromfile(str(path), dtype=np.uint8, count=int(t.n_bytes), offset=int(t.data_offset))
        data = data.view(t.data.dtype).reshape(t.data.shape)
        if arch == "llama" and t.name.endswith(("attn_q.weight", "attn_k.weight", "attn_q.bias", "attn_k.bias")):
            data = data[_unpermute_rows(data.shape[0], n_heads if ".attn_q." in t.name else n_kv_heads)]
        coded = t.tensor_type in CODED_TYPES and data.ndim == 2 and data.shape[0] % 32 == 0 and n_in % 32 == 0
        if coded and name == "model.embed_tokens.weight":
            state[name] = GGUFRows(data, t.tensor_type, n_in)
            if tied:
                state["lm_head.weight"] = codes_from_gguf(data, t.tensor_type, n_in)
            continue
        if coded:
            try:
                state[name] = codes_from_gguf(data, t.tensor_type, n_in)
                continue
            except ValueError:  # a Q4_0 matrix whose fp16 minima overflow in some rows: fp32, as transformers reads it
                pass
        dense = np.asarray(gguf_dequantize(data, t.tensor_type), dtype=np.float32)
        state[name] = torch.from_numpy(dense.reshape(-1, n_in) if data.ndim == 2 else dense.reshape(-1))
    if "model.embed_tokens.weight" not in state:
        raise ValueError(f"GGUF file {path} has no token_embd.weight")
    return state
