"""Fewer bytes per token: weight-only int8 and bf16 copies of a model, for the tiers below the verifier.

Every token is decided by the verifier (the target over the full KV cache), so a tier below it may run cheaper
weights or caches at no loss at all: a worse approximation only lowers its acceptance rate (TriForce,
arXiv 2404.11912, Sec. 4: tier 1 only has to be close to the target). The verifier's own dtype alone defines the
output distribution.

* ``int8``: weight-only, symmetric, per output channel (``w ~= scale[o] * q[o, i]`` with ``q`` in [-127, 127],
  ``scale = max_i |w[o, i]| / 127``), as in gpt-fast's and torchao's int8 weight-only schemes. With fp32
  activations and at most ``kernels.INT8_LINEAR_MAX_ROWS`` rows (decode steps and proposal blocks) the matmul is our
  AVX-512 kernel (``kernels.int8_linear``, fp32 activations and scales); otherwise PyTorch's own
  ``aten._weight_int8pack_mm`` (bf16 activations, int8 weights, fp32 accumulation) where the device has it, and
  elsewhere ``x @ (q * scale)^T`` dequantized on the fly (feature detection with a fallback at every step).
* ``int4``: weight-only, asymmetric, group-wise along the input dimension (groups of :data:`INT4_GROUP` inputs:
  ``w ~= (q - 8) * scale[g, o] + zero[g, o]`` with ``q`` in [0, 15]), the scheme of gpt-fast's and torchao's
  int4 weight-only quantization and of QuantSpec's self-speculative draft (Tiwari et al., arXiv 2502.10424). The
  matmul is PyTorch's ``aten._weight_int4pack_mm_for_cpu`` (bf16 activations, packed 4-bit weights) on the CPU
  where available; elsewhere the dequantized weights (feature detection with a fallback). This is the weight copy
  of the ``self`` tier (the target drafting for itself, ``--draft self``).
* ``bfloat16``: weights (out, in) in bf16 through ``F.linear``.
* ``codes``: a model read from a GGUF file keeps its own block codes (``kernels/blockcodes.py``, no copy of the
  weights), and each product quantizes its activations to int8 per block of 32 inputs for integer dot products, as
  llama.cpp computes (``blockcodes.blockcode_linear_q8``: Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K): the arithmetic
  of a verifier on ``--precision file`` (``model/precision.py``), where this copy changes nothing. A model without
  block codes gets the ``int8`` copy.

Activations stay in the source model's dtype between layers; each quantized matmul converts its input and output.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..defaults import LOWER_WEIGHTS
from ..kernels.cpu import int8_linear
from ..kernels.decode_step import DecodeStep
from ..kernels.stored import dense_weight_t
from .transformer import Linear, Transformer, compile_forward

#: inputs per int4 quantization group (a projection whose input size it does not divide keeps int8)
INT4_GROUP = 32


def _int8pack_supported(device: torch.device) -> bool:
    """Whether ``aten._weight_int8pack_mm`` runs on ``device`` (checked once with a tiny product)."""
    try:
        x = torch.ones(1, 32, dtype=torch.bfloat16, device=device)
        w = torch.ones(8, 32, dtype=torch.int8, device=device)
        s = torch.ones(8, dtype=torch.bfloat16, device=device)
        return bool(torch.ops.aten._weight_int8pack_mm(x, w, s).shape == (1, 8))
    except (RuntimeError, NotImplementedError, AttributeError):
        return False


class Int8Linear(nn.Module):
    """``y = x (scale * q)^T + b``: weight-only int8 with one scale per output channel.

    Args:
        linear: the :class:`~triforce.model.transformer.Linear` to quantize (its ``weight_t`` is (in, out)).

    Attributes:
        q: (out, in) int8.
        scale: (out,) bf16 (PyTorch's op).
        scale_f32: (out,) fp32 (our kernel).
        bias: (out,) in the source dtype, or None.
    """

    def __init__(self, linear: Linear) -> None:
        super().__init__()
        w = dense_weight_t(linear).detach().float().T  # (out, in)
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)  # (out,)
        self.q = nn.Parameter(torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous(),
                              requires_grad=False)
        self.scale = nn.Parameter(scale.to(torch.bfloat16), requires_grad=False)
        self.scale_f32 = nn.Parameter(scale.contiguous(), requires_grad=False)
        self.bias = linear.bias
        self.fast = _int8pack_supported(self.q.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # (M, in)
        y = int8_linear(x2, self.q, self.scale_f32)  # None where our kernel does not apply
        if y is not None:
            y = y.reshape(*shape[:-1], -1)
            return y + self.bias if self.bias is not None else y
        if self.fast:
            y = torch.ops.aten._weight_int8pack_mm(x2.to(torch.bfloat16).contiguous(), self.q, self.scale)
        else:
            y = F.linear(x2, self.q.to(x2.dtype)) * self.scale.to(x2.dtype)
        y = y.to(x.dtype).reshape(*shape[:-1], -1)
        return y + self.bias if self.bias is not None else y


def _int4pack_supported(device: torch.device) -> bool:
    """Whether ``aten._weight_int4pack_mm_for_cpu`` runs on ``device`` (checked once with a tiny product)."""
    if device.type != "cpu":
        return False
    try:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.zeros(16, 64, dtype=torch.int32), 1)
        sz = torch.ones(64 // INT4_GROUP, 16, 2, dtype=torch.bfloat16)
        x = torch.ones(1, 64, dtype=torch.bfloat16)
        return bool(torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, INT4_GROUP, sz).shape == (1, 16))
    except (RuntimeError, NotImplementedError, AttributeError):
        return False


class Int4Linear(nn.Module):
    """``y = x W~^T + b`` with W~ the group-wise int4 approximation of W (see the module docstring).

    Args:
        linear: the :class:`~triforce.model.transformer.Linear` to quantize (its ``weight_t`` is (in, out), ``in``
            divisible by :data:`INT4_GROUP`).

    Attributes:
        packed: the 4-bit weights in the kernel's packed layout (uint8), or None on the fallback path.
        scale_zeros: (in / group, out, 2) bf16: per group and output channel, the scale and the zero point.
        dequantized: (out, in) in the source dtype on the fallback path, else None.
        bias: (out,) in the source dtype, or None.

    Raises:
        ValueError: ``in`` not divisible by the group size.
    """

    def __init__(self, linear: Linear) -> None:
        super().__init__()
        w = dense_weight_t(linear).detach().float().T  # (out, in)
        n_out, n_in = w.shape
        if n_in % INT4_GROUP:
            raise ValueError(f"int4 weights need an input size divisible by {INT4_GROUP}, got {n_in}")
        wg = w.reshape(n_out, n_in // INT4_GROUP, INT4_GROUP)  # (out, groups, group)
        lo, hi = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
        scale = ((hi - lo) / 15).clamp(min=1e-8)  # (out, groups, 1)
        q = torch.round((wg - lo) / scale).clamp(0, 15)  # (out, groups, group) in [0, 15]
        zero = lo + 8 * scale  # w ~= (q - 8) * scale + zero: the kernel's convention
        self.scale_zeros = nn.Parameter(torch.stack([scale[..., 0].T, zero[..., 0].T], -1).to(torch.bfloat16)
                                        .contiguous(), requires_grad=False)  # (groups, out, 2)
        self.bias = linear.bias
        self.packed = self.dequantized = None
        if n_out % 16 == 0 and _int4pack_supported(w.device):  # the kernel packs output channels by 16
            qi = q.reshape(n_out, n_in).to(torch.int32).to(w.device)
            self.packed = nn.Parameter(torch.ops.aten._convert_weight_to_int4pack_for_cpu(qi, 1), requires_grad=False)
        else:
            sz = self.scale_zeros.float()
            deq = (q - 8) * sz[..., 0].T[..., None] + sz[..., 1].T[..., None]  # the kernel's bf16 scales, exactly
            self.dequantized = nn.Parameter(deq.reshape(n_out, n_in).to(torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # (M, in)
        if self.packed is not None:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.to(torch.bfloat16).contiguous(), self.packed,
                                                           INT4_GROUP, self.scale_zeros)
        else:
            y = F.linear(x2, self.dequantized.to(x2.dtype))
        y = y.to(x.dtype).reshape(*shape[:-1], -1)
        return y + self.bias if self.bias is not None else y


class BF16Linear(nn.Module):
    """``y = x W^T + b`` with W (out, in) in bf16 (``F.linear``'s layout, the faster one for bf16 GEMV on CPU)."""

    def __init__(self, linear: Linear) -> None:
        super().__init__()
        self.weight = nn.Parameter(dense_weight_t(linear).detach().T.to(torch.bfloat16).contiguous(),
                                   requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x.to(torch.bfloat16), self.weight).to(x.dtype)
        return y + self.bias if self.bias is not None else y


def lower_precision_copy(model: Transformer, weights: str) -> Transformer:
    """A copy of ``model`` whose projections and LM head use ``weights`` (one of :data:`LOWER_WEIGHTS`).

    Norms, RoPE and (for untied models) the embedding table are shared with ``model``, not copied; tied embeddings
    keep reading the source LM head's matrix. The copy is for speculation tiers below the verifier. When ``model``
    was compiled (:meth:`~triforce.model.transformer.Transformer.compile_blocks`), each copied MLP gets its own
    compiled forward: the source's compiled forward is bound to the source's full-precision MLP and must not travel with
    the copy.

    Args:
        model: the source model (any dtype, one rank's shard under tensor parallelism included).
        weights: one of :data:`LOWER_WEIGHTS`.

    Returns:
        a :class:`~triforce.model.transformer.Transformer` with attribute ``weights`` naming the scheme.

    Raises:
        ValueError: an unknown ``weights`` value (the allowed ones are in the message).
    """
    if weights not in LOWER_WEIGHTS:
        raise ValueError(f"lower_weights must be one of {', '.join(LOWER_WEIGHTS)}, got {weights!r}")
    if weights == "codes":
        if not model.layers_on_codes():
            return lower_precision_copy(model, "int8")  # no block codes in every layer (module docstring)
        return _int8_activations_copy(model)
    kinds = {"int8": Int8Linear, "int4": Int4Linear, "bfloat16": BF16Linear}

    def make(linear: nn.Module) -> nn.Module:
        if isinstance(linear, Int8Linear):  # a verifier quantized itself (``quantize="int8"``): its int8 weights
            if weights == "int8":
                return linear  # the same tensors
            linear = _Dequantized(linear)
        n_in = linear.weight_t.shape[0] if linear.weight_t is not None else linear.codes.in_features
        if weights == "int4" and n_in % INT4_GROUP:
            return Int8Linear(linear)  # a projection int4's groups do not fit keeps int8
        return kinds[weights](linear)

    out = _with_linears(model, make)
    # tied embeddings read the source LM head's fp32 matrix (a source quantized itself keeps that matrix's reference)
    head = getattr(model.lm_head, "weight_t", None)
    out.tied_embedding = (model.tied_embedding if head is None else head) if model.embed_tokens is None else None
    out.weights = weights
    out.decode_step = None
    if weights == "int8" and model.tp is None and model.dtype == torch.float32 and model.device.type == "cpu":
        try:
            out.decode_step = DecodeStep(out)
        except ValueError:
            pass  # a layout the kernel does not take: the layers run in Python
    return out


def int8_copy_bytes(model: Transformer) -> int:
    """Bytes of ``lower_precision_copy(model, "int8")``'s projections and LM head (:class:`Int8Linear`: one int8 byte
    a weight and an fp32 scale per output row), whatever bytes ``model`` stores them in (fp32, 2-byte or block codes):
    what a step of an int8 tier reads, for ``auto``'s plan (``auto.choose_hierarchy``'s ``int8_weight_bytes``).

    Args:
        model: the target (any layout :func:`lower_precision_copy` takes; an int8 copy counts itself).

    Returns:
        bytes, an int. Raises nothing.
    """
    linears = [model.lm_head] + [lin for block in model.layers for lin in (
        block.self_attn.qkv_proj, block.self_attn.o_proj, block.mlp.gate_up_proj, block.mlp.down_proj)]
    shapes = [tuple(lin.q.shape) if isinstance(lin, Int8Linear) else tuple(lin.weight_t.shape[::-1])
              if lin.weight_t is not None else (lin.codes.out_features, lin.codes.in_features) for lin in linears]
    return sum(o * i + 4 * o for o, i in shapes)


class _Dequantized:
    """An :class:`Int8Linear`'s weights as a :class:`~.transformer.Linear`'s ``weight_t`` (in, out) fp32 and
    ``bias``: the source of a cheaper copy (int4, bf16) of a verifier that was quantized to int8 itself."""

    def __init__(self, linear: Int8Linear) -> None:
        self.weight_t = (linear.q.float() * linear.scale_f32[:, None]).T
        self.bias = linear.bias


def _with_linears(model: Transformer, make) -> Transformer:
    """A shallow copy of ``model`` whose LM head and layer projections are ``make(linear)``; everything else (norms,
    RoPE, embeddings) is shared. A compiled source's MLP forward is bound to the source MLP: each copied MLP gets its
    own."""
    import copy

    out = copy.copy(model)  # shallow: shares submodules until replaced below
    out._modules = dict(model._modules)
    out._parameters = dict(model._parameters)
    out._buffers = dict(model._buffers)
    out.lm_head = make(model.lm_head)
    layers = []
    for block in model.layers:
        b = copy.copy(block)
        b._modules = dict(block._modules)
        attn, mlp = copy.copy(block.self_attn), copy.copy(block.mlp)
        attn._modules, mlp._modules = dict(block.self_attn._modules), dict(block.mlp._modules)
        mlp.__dict__.pop("forward", None)  # a compiled source's forward, bound to the source MLP
        attn.qkv_proj, attn.o_proj = make(block.self_attn.qkv_proj), make(block.self_attn.o_proj)
        mlp.gate_up_proj, mlp.down_proj = make(block.mlp.gate_up_proj), make(block.mlp.down_proj)
        if getattr(model, "compile_mode", None) is not None:  # the norms are shared, already compiled
            mlp.forward = compile_forward(mlp.forward, model.compile_mode)
        b.self_attn, b.mlp = attn, mlp
        layers.append(b)
    out.layers = nn.ModuleList(layers)
    return out


def _int8_activations_copy(model: Transformer) -> Transformer:
    """``lower_precision_copy(model, "codes")`` for a model whose every layer has block codes: the same tensors, but
    each :class:`~triforce.model.transformer.Linear` with codes is a shallow copy with ``q8`` set, and the copy has its
    own one-call decode step over them."""
    import copy

    def q8(linear: nn.Module) -> nn.Module:
        if not isinstance(linear, Linear) or linear.codes is None:
            return linear
        out = copy.copy(linear)  # shares weight_t, codes, bias
        out._parameters = dict(linear._parameters)
        out.q8 = True
        return out

    out = _with_linears(model, q8)
    out.weights = "codes"
    out.decode_step = DecodeStep(out)
    return out
