"""An int8 lower tier's decode step in one C call (``csrc/decode_step.c``): every decoder layer of one token over a
retrieval cache, with the kernels of :mod:`triforce.kernels` called back to back from C, so that neither Python nor
sleeping OpenMP threads sit between two products (1.75x faster than one Python call per operation for SmolLM2 at
8K tokens on this project's 2-core AVX2 CPU, ``bench/decode_step.py``). ``TRIFORCE_DECODE_STEP_KERNEL=0`` turns it
off; feature detection with a fallback (None: the model runs its layers in Python)."""

from __future__ import annotations

import ctypes
import math

import torch

from .kernels import (_F, _I, _I64, _P, CHUNK, DECODE_STEP_CFLAGS, DECODE_STEP_ENV_SWITCH, MAX_HEAD_DIM, _attention,
                      _Library, _linear, _norm_rope)

_decode_step = _Library("decode_step.c", DECODE_STEP_ENV_SWITCH, (), lambda: (DECODE_STEP_CFLAGS, "C"), {
    "triforce_int8_decode_layers": (_I, [_P, _P] + [_I] * 6 + [_F] + [_P] * 6 + [_I64] * 2 + [_I] * 2 + [_P] * 2
                                    + [_I, _F, _I, _P, _P])})
_fn_table = None  # the kernels' addresses in the order csrc/decode_step.c takes them, built on first use


def decode_step_status() -> str:
    """'on (...)', 'off (...)' or 'unavailable: <reason>' for the one-call decode step of int8 lower tiers (loads it
    and the kernels it calls if nobody has yet)."""
    for lib in (_linear, _norm_rope, _attention):
        if lib.load() is None:
            return f"unavailable: it calls csrc/{lib.source}, {lib.status}"
    _decode_step.load()
    return _decode_step.status


class Int8LayerTable:
    """Every decoder layer's weights of an int8 model as the pointer tables of :func:`int8_decode_layers`.

    Built once per model (the tensors are kept here, so the pointers stay valid); see ``csrc/decode_step.c``.

    Args:
        norms: 2 per layer, (d,) fp32 contiguous: the input and post-attention RMSNorm weights, layer by layer.
        qs: 4 per layer (qkv, o, gate_up, down): (out, in) int8 contiguous weights.
        scales: 4 per layer: (out,) fp32 contiguous per-channel scales.
        biases: 4 per layer: (out,) fp32 contiguous, or None.
        dims: (d, nh, nkv, hs, inter) of the model; ``eps`` its RMSNorm epsilon.

    Raises:
        ValueError: tables whose lengths, shapes, dtypes or layouts do not match (the parameter is named).
    """

    def __init__(self, norms: list, qs: list, scales: list, biases: list, dims: tuple[int, int, int, int, int],
                 eps: float) -> None:
        d, nh, nkv, hs, inter = dims
        n_layers = len(qs) // 4
        if len(norms) != 2 * n_layers or len(scales) != 4 * n_layers or len(biases) != 4 * n_layers or len(qs) % 4:
            raise ValueError(f"Int8LayerTable: norms, qs, scales, biases must hold 2, 4, 4, 4 entries per layer, got "
                             f"{len(norms)}, {len(qs)}, {len(scales)}, {len(biases)}")
        shapes = [(nh * hs + 2 * nkv * hs, d), (d, nh * hs), (2 * inter, d), (d, inter)]
        for i, (q, s, b) in enumerate(zip(qs, scales, biases)):
            want = shapes[i % 4]
            ok = (q.dtype == torch.int8 and tuple(q.shape) == want and q.is_contiguous() and q.device.type == "cpu"
                  and s.dtype == torch.float32 and tuple(s.shape) == want[:1] and s.is_contiguous())
            ok = ok and (b is None or (b.dtype == torch.float32 and tuple(b.shape) == want[:1] and b.is_contiguous()))
            if not ok:
                raise ValueError(f"Int8LayerTable: qs/scales/biases[{i}] must be int8 {want} with fp32 ({want[0]},) "
                                 f"scales and bias, contiguous on the CPU")
        for i, w in enumerate(norms):
            if w.dtype != torch.float32 or tuple(w.shape) != (d,) or not w.is_contiguous():
                raise ValueError(f"Int8LayerTable: norms[{i}] must be fp32 ({d},) contiguous")
        self.dims, self.eps, self.n_layers = dims, float(eps), n_layers
        self._keep = (norms, qs, scales, biases)

        def table(ts):
            return (ctypes.c_void_p * len(ts))(*[None if t is None else t.data_ptr() for t in ts])

        self.norms, self.qs, self.scales, self.biases = table(norms), table(qs), table(scales), table(biases)
        self.work = torch.empty(3 * nh * hs + 3 * nkv * hs + 2 * d + 3 * inter, dtype=torch.float32)


def int8_decode_layers(table: Int8LayerTable, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot: int,
                       n_keys: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """Every decoder layer of one decode step of an int8 model in one call (``csrc/decode_step.c``), or None.

    Computes what :class:`~triforce.model.Block` computes layer after layer for one token (RMSNorm, int8 products,
    RoPE, the key and value written to row ``slot``, attention over rows [0, n_keys), SwiGLU, residuals) with the same
    kernels (:func:`~triforce.kernels.int8_linear`, :func:`~triforce.kernels.rms_norm`, :func:`~triforce.kernels.rope`,
    :func:`~triforce.kernels.gqa_attention_kernel`), without a Python
    call between them; only SiLU's exponential may round differently from PyTorch's.

    Args:
        table: the model's weights (:class:`Int8LayerTable`).
        x: (1, 1, d) fp32, the embedded token (not modified).
        k, v: (L, 1, nkv, capacity, hs) fp32 contiguous CPU caches; row ``slot`` of every layer and head is written.
        slot: the row this token's key and value go to, 0 <= slot < n_keys.
        n_keys: the rows [0, n_keys) the query attends over (all of them visible to it), n_keys <= capacity.
        cos, sin: (1, hs) fp32 contiguous, this position's rotation.

    Returns:
        (1, 1, d) fp32, the hidden state after the last layer (before the final norm); or None when the kernels do not
        apply (shapes, dtypes, layouts; head size not a multiple of 8 or over :data:`~triforce.kernels.MAX_HEAD_DIM`; a kernel
        unavailable): the caller then runs the layers in Python.
    """
    d, nh, nkv, hs, inter = table.dims
    L = table.n_layers
    if (x.shape != (1, 1, d) or x.dtype != torch.float32 or x.device.type != "cpu" or k.shape != v.shape
            or k.dim() != 5 or tuple(k.shape[:3]) != (L, 1, nkv) or k.shape[4] != hs or k.dtype != torch.float32
            or v.dtype != torch.float32 or k.device.type != "cpu" or v.device.type != "cpu" or not k.is_contiguous()
            or not v.is_contiguous() or not 0 <= slot < n_keys <= k.shape[3] or hs % 8 or hs > MAX_HEAD_DIM
            or nh % nkv or cos.shape != (1, hs) or sin.shape != (1, hs) or cos.dtype != torch.float32
            or sin.dtype != torch.float32 or not cos.is_contiguous() or not sin.is_contiguous()):
        return None
    libs = [lib.load() for lib in (_linear, _norm_rope, _attention, _decode_step)]
    if any(fns is None for fns in libs):
        return None
    global _fn_table
    if _fn_table is None:
        _fn_table = (ctypes.c_void_p * 4)(*[ctypes.cast(f, ctypes.c_void_p).value for f in (
            libs[0]["triforce_int8_linear"], libs[1]["triforce_rms_norm"], libs[1]["triforce_rope"],
            libs[2]["triforce_gqa_attention"])])
    threads = torch.get_num_threads()
    rows = nh // nkv
    scratch = torch.empty(nkv * -(-n_keys // CHUNK) * rows * (hs + 2) + threads * rows * CHUNK, dtype=torch.float32)
    out = x.clone()
    cap = k.shape[3]
    rc = libs[3]["triforce_int8_decode_layers"](
        _fn_table, out.data_ptr(), L, d, nh, nkv, hs, inter, table.eps, table.norms, table.qs, table.scales, table.biases,
        k.data_ptr(), v.data_ptr(), nkv * cap * hs, cap * hs, slot, n_keys, cos.data_ptr(), sin.data_ptr(), CHUNK,
        1.0 / math.sqrt(hs), threads, table.work.data_ptr(), scratch.data_ptr())
    return out if rc == 0 else None
