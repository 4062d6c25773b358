"""A decode step in one C call (``csrc/decode_step.c``): every decoder layer of one token, with the kernels of
:mod:`triforce.kernels.cpu` (and :mod:`triforce.kernels.blockcodes`) called back to back from C, so that neither Python
nor sleeping OpenMP threads sit between two products. Models whose projections are all int8 (the lower tiers' copies,
``model/quant.py``) or all block codes (a GGUF model's verifier, ``kernels/blockcodes.py``) get a :class:`DecodeStep`;
the cache says where it applies (:meth:`~triforce.kv.caches.KVCache.one_query_rows`: a retrieval step, a full-cache
decode step), over an fp32 or a bf16 cache (a lower tier's ``lower_kv_dtype``, which ``auto`` picks for its retrieval
tier). ``TRIFORCE_DECODE_STEP_KERNEL=0`` turns it off; feature detection with a fallback (None: the model runs its
layers in Python). What it saves: ``bench/kernels/decode_step.py``."""

from __future__ import annotations

import ctypes
import math

import torch

from .blockcodes import GROUP, Q8_WORK_FLOATS, _blockcodes
from .codes import BlockCodes
from .cpu import (
    _F,
    _I,
    _I64,
    _P,
    CHUNK,
    DECODE_STEP_CFLAGS,
    DECODE_STEP_ENV_SWITCH,
    MAX_HEAD_DIM,
    _attention,
    _Library,
    _linear,
    _norm_rope,
)

_decode_step = _Library("decode_step.c", DECODE_STEP_ENV_SWITCH, (), lambda: (DECODE_STEP_CFLAGS, "C"), {
    "triforce_decode_layers": (_I, [_P, _P] + [_I] * 7 + [_F] + [_P] * 8 + [_I, _P] + [_I64] * 2 + [_I] * 3
                               + [_P] * 2 + [_I, _F, _I, _P, _P]),
    "triforce_decode_layers_ragged": (_I, [_P, _P, _I, _P] + [_I] * 6 + [_F] + [_P] * 8 + [_I] + [_P] * 7
                                      + [_I, _F, _I, _P, _P]),
    "triforce_silu_mul": (None, [_P, _P, _P, _I]), "triforce_silu_mul_isa": (_I, [_P, _P, _P, _I, _I])})
_fn_table = None  # the kernels' addresses in the order csrc/decode_step.c takes them, built on first use
#: most tokens of one call (csrc/decode_step.c's MAX_T): decode steps and verification blocks (gamma + 1), up to
#: :data:`~triforce.kernels.rows.EXACT_MAX_BLOCK`, so that the verifier's blocks and its decode steps take the same path
#: (longer verification blocks run in pieces of at most this many, ``exact.verify_forward``: one call each)
MAX_BLOCK = 64
#: most tokens of one call in the retrieval cache's layout (a lower tier's block; longer ones run layer by layer)
RETRIEVAL_MAX_BLOCK = 16
#: most rows of one ragged call (csrc/decode_step.c's MAX_RAGGED_T: the products' row limit)
MAX_RAGGED_ROWS = 64
#: added to a weight's bits: its block codes multiply int8-quantized activations (csrc/decode_step.c's Q8_ACTIVATIONS)
Q8_ACTIVATIONS = 256


def decode_step_status() -> str:
    """'on (...)', 'off (...)' or 'unavailable: <reason>' for the one-call decode step (loads it and the kernels it
    calls if nobody has yet)."""
    for lib in (_linear, _norm_rope, _attention):
        if lib.load() is None:
            return f"unavailable: it calls csrc/{lib.source}, {lib.status}"
    _decode_step.load()
    return _decode_step.status


class LayerTable:
    """Every decoder layer's weights as the pointer tables of :func:`decode_layers`.

    Built once per model (the tensors are kept here, so the pointers stay valid); see ``csrc/decode_step.c``.

    Args:
        norms: 2 per layer, (d,) fp32 contiguous: the input and post-attention RMSNorm weights, layer by layer.
        weights: 4 per layer (qkv, o, gate_up, down), each either ``(q, scale)``: (out, in) int8 and (out,) fp32
            per-channel scales, contiguous (:class:`~triforce.model.quant.Int8Linear`), or a
            :class:`~triforce.kernels.codes.BlockCodes` of the (in, out) matrix.
        biases: 4 per layer: (out,) fp32 contiguous, or None.
        dims: (d, nh, nkv, hs, inter) of the model; ``eps`` its RMSNorm epsilon.
        q8: None, or one bool per weight: block codes multiplied by int8-quantized activations
            (:func:`~triforce.kernels.blockcodes.blockcode_linear_q8`: a tier below the verifier), where those codes
            allow it.

    Raises:
        ValueError: tables whose lengths, shapes, dtypes or layouts do not match (the parameter is named).
    """

    def __init__(self, norms: list, weights: list, biases: list, dims: tuple[int, int, int, int, int],
                 eps: float, q8: list[bool] | None = None) -> None:
        d, nh, nkv, hs, inter = dims
        n_layers = len(weights) // 4
        if len(norms) != 2 * n_layers or len(biases) != 4 * n_layers or len(weights) % 4:
            raise ValueError(f"LayerTable: norms, weights, biases must hold 2, 4, 4 entries per layer, got "
                             f"{len(norms)}, {len(weights)}, {len(biases)}")
        shapes = [(nh * hs + 2 * nkv * hs, d), (d, nh * hs), (2 * inter, d), (d, inter)]  # (out, in)
        qs, scales, mins, bits = [], [], [], []
        for i, (w, b) in enumerate(zip(weights, biases)):
            want = shapes[i % 4]
            if isinstance(w, BlockCodes):
                ok = (w.out_features, w.in_features) == want
                if ok:
                    q8_here = bool(q8 and q8[i]) and w.q8_dot_ok
                    qs.append(w.codes), scales.append(w.d), mins.append(w.m)
                    bits.append(w.kernel_bits | (Q8_ACTIVATIONS if q8_here else 0))
            else:
                q, s = w
                ok = (q.dtype == torch.int8 and tuple(q.shape) == want and q.is_contiguous() and q.device.type == "cpu"
                      and s.dtype == torch.float32 and tuple(s.shape) == want[:1] and s.is_contiguous())
                if ok:
                    qs.append(q), scales.append(s), mins.append(None), bits.append(0)
            ok = ok and (b is None or (b.dtype == torch.float32 and tuple(b.shape) == want[:1] and b.is_contiguous()))
            if not ok:
                raise ValueError(f"LayerTable: weights/biases[{i}] must be int8 {want} with fp32 ({want[0]},) scales, "
                                 f"or block codes of that matrix, and an fp32 ({want[0]},) bias, contiguous on the CPU")
        for i, w in enumerate(norms):
            if w.dtype != torch.float32 or tuple(w.shape) != (d,) or not w.is_contiguous():
                raise ValueError(f"LayerTable: norms[{i}] must be fp32 ({d},) contiguous")
        self.dims, self.eps, self.n_layers = dims, float(eps), n_layers
        self.codes = any(bits)  # the block-code kernel is needed
        self._keep = (norms, qs, scales, mins, biases)

        def table(ts):
            return (ctypes.c_void_p * len(ts))(*[None if t is None else t.data_ptr() for t in ts])

        self.norms, self.qs, self.scales, self.mins, self.biases = (table(norms), table(qs), table(scales),
                                                                    table(mins), table(biases))
        self.bits = (ctypes.c_int * len(bits))(*bits)
        n_in = max(d, nh * hs, inter)  # the widest projection input (the integer dot products' activations)
        self.work = torch.empty(MAX_BLOCK * (6 * nh * hs + 4 * nkv * hs + 2 * d + 3 * inter + 3 * nh + 2 * n_in
                                             + Q8_WORK_FLOATS * n_in // GROUP) + 8,
                                dtype=torch.float32)  # csrc/decode_step.c's work


def decode_layers(table: LayerTable, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot: int,
                  n_keys: int, cos: torch.Tensor, sin: torch.Tensor,
                  queries: torch.Tensor | None = None, shared: int | None = None) -> torch.Tensor | None:
    """Every decoder layer of a decode step or a short block in one call (``csrc/decode_step.c``), or None.

    Computes what :class:`~triforce.model.transformer.Block` computes layer after layer for a block of T tokens
    (RMSNorm, the products, RoPE, the keys and values written to rows ``slot .. slot + T - 1``, causal attention over
    rows [0, n_keys), SwiGLU, residuals) with the same kernels (:func:`~triforce.kernels.cpu.int8_linear` or
    :func:`~triforce.kernels.blockcodes.blockcode_linear`, :func:`~triforce.kernels.cpu.rms_norm`,
    :func:`~triforce.kernels.cpu.rope`, :func:`~triforce.kernels.cpu.gqa_attention_kernel`), without a Python call
    between them; only SiLU's exponential may round differently from PyTorch's.

    Args:
        table: the model's weights (:class:`LayerTable`).
        x: (1, T, d) fp32, the embedded tokens, 1 <= T <= :data:`MAX_BLOCK` (not modified).
        k, v: (L, 1, nkv, capacity, hs) contiguous CPU caches, both fp32 or both bf16 (a lower tier's
            ``lower_kv_dtype``: the rows written are rounded to nearest even as ``Tensor.to`` rounds, and the block
            attends to its own keys and values as rounded, as to the others); rows ``slot .. slot + T - 1`` of every
            layer and head are written.
        slot: the row of the block's first key and value, 0 <= slot, slot + T <= n_keys.
        n_keys: the rows [0, n_keys) the queries attend over, n_keys <= capacity: token i of the block sees rows
            j <= n_keys - T + i (T > 1 needs n_keys = slot + T, the full cache's causal block).
        cos, sin: (T, hs) fp32 contiguous, the positions' rotations.
        queries: None, or (L, 1, nh, T, hs) fp32 contiguous: receives every layer's rotated queries (what
            :class:`~triforce.kv.caches.FullKVCache` records for the retrieval cache's chunk selection).
        shared: None for the layout above; an int for :class:`~triforce.kv.retrieval.RetrievalCache`'s (generated tokens
            from the end, newest lowest): token t is written to row ``slot - t``, rows [0, shared) and
            [slot + 1, n_keys) are seen by every token of the block, and token i sees the block's tokens 0 .. i
            (0 <= shared <= slot - T + 1, slot < n_keys).

    Returns:
        (1, T, d) fp32, the hidden states after the last layer (before the final norm); or None when the kernels do not
        apply (shapes, dtypes, layouts; head size not a multiple of 8 or over
        :data:`~triforce.kernels.cpu.MAX_HEAD_DIM`; a kernel unavailable): the caller then runs the layers in Python.
    """
    d, nh, nkv, hs, inter = table.dims
    L = table.n_layers
    T = x.shape[1] if x.dim() == 3 else 0
    if shared is None:
        rows_ok = (T == 1 or n_keys == slot + T) and 0 <= slot <= n_keys - T
    else:
        rows_ok = 0 <= shared <= slot - T + 1 and slot < n_keys
    if (x.shape != (1, T, d) or not 1 <= T <= MAX_BLOCK or not rows_ok or x.dtype != torch.float32
            or x.device.type != "cpu" or not _cache_ok(table, k, v, n_keys, queries, T)
            or not _rotations_ok(table, cos, sin, T)):
        return None
    lib = _kernels(table)
    if lib is None:
        return None
    threads = torch.get_num_threads()
    scratch = _attention_scratch(nh // nkv * T, n_keys, nkv, hs, threads)
    out = x.contiguous().clone()
    cap = k.shape[3]
    rc = lib["triforce_decode_layers"](
        _fn_table, out.data_ptr(), T, L, d, nh, nkv, hs, inter, table.eps, table.norms, table.qs, table.scales,
        table.mins, table.bits, table.biases, k.data_ptr(), v.data_ptr(), int(k.dtype == torch.bfloat16),
        None if queries is None else queries.data_ptr(), nkv * cap * hs, cap * hs, slot, n_keys,
        -1 if shared is None else shared, cos.data_ptr(), sin.data_ptr(), CHUNK, 1.0 / math.sqrt(hs), threads,
        table.work.data_ptr(), scratch.data_ptr())
    return out if rc == 0 else None


def _cache_ok(table: LayerTable, k: torch.Tensor, v: torch.Tensor, n_keys: int, queries: torch.Tensor | None,
              t: int) -> bool:
    """Whether ``k``, ``v`` are (L, 1, nkv, capacity >= n_keys, hs) contiguous CPU caches, both fp32 or both bf16, and
    ``queries`` None or (L, 1, nh, t, hs) fp32 contiguous."""
    _, nh, nkv, hs, _ = table.dims
    L = table.n_layers
    return not (k.shape != v.shape or k.dim() != 5 or tuple(k.shape[:3]) != (L, 1, nkv) or k.shape[4] != hs
                or k.dtype not in (torch.float32, torch.bfloat16) or v.dtype != k.dtype
                or k.device.type != "cpu" or v.device.type != "cpu" or not k.is_contiguous()
                or not v.is_contiguous() or n_keys > k.shape[3]
                or (queries is not None and (queries.shape != (L, 1, nh, t, hs) or queries.dtype != torch.float32
                                             or not queries.is_contiguous())))


def _rotations_ok(table: LayerTable, cos: torch.Tensor, sin: torch.Tensor, t: int) -> bool:
    """Whether the heads fit the kernels (hs a multiple of 8 up to ``MAX_HEAD_DIM``, nh a multiple of nkv) and
    ``cos``, ``sin`` are (t, hs) fp32 contiguous."""
    _, nh, nkv, hs, _ = table.dims
    return not (hs % 8 or hs > MAX_HEAD_DIM or nh % nkv or cos.shape != (t, hs) or sin.shape != (t, hs)
                or cos.dtype != torch.float32 or sin.dtype != torch.float32 or not cos.is_contiguous()
                or not sin.is_contiguous())


def _kernels(table: LayerTable) -> dict | None:
    """``csrc/decode_step.c``'s functions with the kernels it calls in :data:`_fn_table` (built on first use), or
    None where one of them is unavailable."""
    libs = [lib.load() for lib in (_linear, _norm_rope, _attention, _decode_step)]
    if any(fns is None for fns in libs):
        return None
    codes = _blockcodes.load()
    if table.codes and codes is None:
        return None
    global _fn_table
    if _fn_table is None:
        fns = [libs[0]["triforce_int8_linear"], libs[1]["triforce_rms_norm"], libs[1]["triforce_rope"],
               libs[2]["triforce_gqa_attention"]] + ([codes["triforce_blockcode_linear"],
                                                      codes["triforce_blockcode_linear_q8"]] if codes else [None, None])
        fns.append(libs[2]["triforce_gqa_attention_bf16"])
        _fn_table = (ctypes.c_void_p * 7)(*[None if f is None else ctypes.cast(f, ctypes.c_void_p).value
                                            for f in fns])
    return libs[3]


def _attention_scratch(rows: int, n_keys: int, nkv: int, hs: int, threads: int) -> torch.Tensor:
    """What ``triforce_gqa_attention`` needs for ``rows`` query rows per KV head over ``n_keys`` keys (fp32)."""
    return torch.empty(nkv * -(-n_keys // CHUNK) * rows * (hs + 2) + threads * rows * CHUNK, dtype=torch.float32)


def decode_layers_ragged(table: LayerTable, x: torch.Tensor, segments: list[tuple], cos: torch.Tensor,
                         sin: torch.Tensor) -> torch.Tensor | None:
    """:func:`decode_layers` for the blocks of several sequences in one call (continuous batching,
    :meth:`~triforce.model.transformer.Transformer.forward_ragged`): the products once over every row, RoPE, the cache
    writes and the attention of each sequence over its own full cache. Each row equals what :func:`decode_layers` gives
    its sequence alone, bitwise (the products are row-invariant up to :data:`MAX_RAGGED_ROWS` rows).

    Args:
        table: the model's weights (:class:`LayerTable`).
        x: (1, T, d) fp32, the sequences' embedded tokens one block after another, T <= :data:`MAX_RAGGED_ROWS`.
        segments: per sequence, in the order of its block in ``x``: ``(k, v, slot, n_keys, queries)`` as
            :func:`decode_layers` takes them for a full cache (``shared`` None; block of ``n_keys - slot`` tokens,
            1 <= that <= :data:`MAX_BLOCK`), every cache fp32, or every cache bf16.
        cos, sin: (T, hs) fp32 contiguous, the rows' rotations, in the order of ``x``.

    Returns:
        (1, T, d) fp32 after the last layer; or None where the kernels or the shapes do not apply (the caller then
        runs the layers in Python).
    """
    d, nh, nkv, hs, inter = table.dims
    L = table.n_layers
    T = x.shape[1] if x.dim() == 3 else 0
    lengths = [n_keys - slot for _, _, slot, n_keys, _ in segments]
    if (not segments or x.shape != (1, T, d) or T != sum(lengths) or T > MAX_RAGGED_ROWS or x.dtype != torch.float32
            or x.device.type != "cpu" or not _rotations_ok(table, cos, sin, T)):
        return None
    dtype = segments[0][0].dtype
    for (k, v, slot, n_keys, queries), t in zip(segments, lengths):
        if not 1 <= t <= MAX_BLOCK or slot < 0 or k.dtype != dtype or not _cache_ok(table, k, v, n_keys, queries, t):
            return None
    lib = _kernels(table)
    if lib is None:
        return None
    threads = torch.get_num_threads()
    work = torch.empty(T * (6 * nh * hs + 4 * nkv * hs + 2 * d + 3 * inter + 3 * nh + 2 * max(d, nh * hs, inter)
                            + Q8_WORK_FLOATS * max(d, nh * hs, inter) // GROUP) + 8, dtype=torch.float32)
    scratch = max((_attention_scratch(nh // nkv * t, n_keys, nkv, hs, threads)
                   for (_, _, _, n_keys, _), t in zip(segments, lengths)), key=torch.Tensor.numel)
    S = len(segments)

    def array(kind, values):
        return (kind * S)(*values)

    out = x.contiguous().clone()
    rc = lib["triforce_decode_layers_ragged"](
        _fn_table, out.data_ptr(), S, array(ctypes.c_int, lengths), L, d, nh, nkv, hs, inter, table.eps,
        table.norms, table.qs, table.scales, table.mins, table.bits, table.biases,
        array(ctypes.c_void_p, [s[0].data_ptr() for s in segments]),
        array(ctypes.c_void_p, [s[1].data_ptr() for s in segments]), int(dtype == torch.bfloat16),
        array(ctypes.c_void_p, [None if s[4] is None else s[4].data_ptr() for s in segments]),
        array(ctypes.c_int64, [nkv * s[0].shape[3] * hs for s in segments]),
        array(ctypes.c_int64, [s[0].shape[3] * hs for s in segments]),
        array(ctypes.c_int, [s[2] for s in segments]), array(ctypes.c_int, [s[3] for s in segments]),
        cos.data_ptr(), sin.data_ptr(), CHUNK, 1.0 / math.sqrt(hs), threads, work.data_ptr(), scratch.data_ptr())
    return out if rc == 0 else None


class DecodeStep:
    """A model's decode step in one kernel call: :func:`decode_layers` over its :class:`LayerTable`, for the
    forwards whose cache offers it (:meth:`~triforce.kv.caches.KVCache.one_query_rows`). Set as the model's
    ``decode_step`` by :func:`~triforce.model.quant.lower_precision_copy` (int8 copies) and
    :meth:`~triforce.model.transformer.Transformer.attach_block_codes` (block codes);
    :meth:`~triforce.model.transformer.Transformer.forward` calls it.

    Args:
        model: a :class:`~triforce.model.transformer.Transformer` whose every layer projection is int8 (``q``,
            ``scale_f32``: :class:`~triforce.model.quant.Int8Linear`) or has block codes (``codes``; with ``q8`` set,
            multiplied by int8-quantized activations), fp32 norms, no tensor parallelism.

    Raises:
        ValueError: a model the kernel does not take (see :class:`LayerTable`).
    """

    def __init__(self, model) -> None:
        cfg = model.cfg
        norms, weights, biases, q8 = [], [], [], []
        for block in model.layers:
            norms += [block.input_layernorm.weight.detach(), block.post_attention_layernorm.weight.detach()]
            for lin in (block.self_attn.qkv_proj, block.self_attn.o_proj, block.mlp.gate_up_proj, block.mlp.down_proj):
                if getattr(lin, "codes", None) is not None:
                    weights.append(lin.codes)
                    q8.append(getattr(lin, "q8", False))
                elif hasattr(lin, "q") and hasattr(lin, "scale_f32"):
                    weights.append((lin.q.detach(), lin.scale_f32.detach()))
                    q8.append(False)
                else:
                    raise ValueError(f"DecodeStep: every projection must be int8 or block codes, got "
                                     f"{type(lin).__name__}")
                biases.append(None if lin.bias is None else lin.bias.detach())
        self.table = LayerTable(norms, weights, biases, (cfg.hidden_size, cfg.num_attention_heads,
                                cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size), cfg.rms_norm_eps,
                                q8)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache) -> torch.Tensor | None:
        """(1, T, d) fp32 embedded tokens, their (T, hs) rotations and the cache -> (1, T, d) after the last layer,
        or None (a block the cache offers no rows for, or the kernels do not apply). Several sequences' blocks (a
        :class:`~triforce.kv.caches.RaggedCache`) run in calls of at most :data:`MAX_RAGGED_ROWS` rows, whole blocks
        each: every row is bitwise what its sequence gets alone, whatever the batch."""
        segments = getattr(cache, "segment_rows", None)  # a RaggedCache: several sequences' blocks
        if segments is not None:
            segments = segments() if x.shape[0] == 1 else None
            return None if segments is None else _ragged_in_groups(self.table, x, segments, cos, sin)
        rows = cache.one_query_rows() if x.shape[0] == 1 and x.shape[1] <= MAX_BLOCK else None
        if rows is None or (rows[4] is not None and x.shape[1] > RETRIEVAL_MAX_BLOCK):
            return None
        k, v, slot, n_keys, shared = rows
        return decode_layers(self.table, x, k, v, slot, n_keys, cos, sin, cache.query_buffer(), shared)


def _ragged_in_groups(table: LayerTable, x: torch.Tensor, segments: list[tuple], cos: torch.Tensor,
                      sin: torch.Tensor) -> torch.Tensor | None:
    """:func:`decode_layers_ragged` over consecutive groups of whole blocks of at most :data:`MAX_RAGGED_ROWS` rows
    (one group where they fit): the same rows, bitwise, as one call would give (the products are row-invariant and
    each block's attention is its own). None where a call gives None (the caller then runs the layers in Python,
    which writes every cache row again)."""
    lengths = [n_keys - slot for _, _, slot, n_keys, _ in segments]
    if sum(lengths) <= MAX_RAGGED_ROWS:
        return decode_layers_ragged(table, x, segments, cos, sin)
    groups, start = [[]], 0  # each: (segment index, first row)
    for i, t in enumerate(lengths):
        if groups[-1] and sum(lengths[j] for j, _ in groups[-1]) + t > MAX_RAGGED_ROWS:
            groups.append([])
        groups[-1].append((i, start))
        start += t
    outs = []
    for group in groups:
        a = group[0][1]
        b = group[-1][1] + lengths[group[-1][0]]
        out = decode_layers_ragged(table, x[:, a:b], [segments[i] for i, _ in group], cos[a:b], sin[a:b])
        if out is None:
            return None
        outs.append(out)
    return torch.cat(outs, dim=1)
