"""Fewer bytes per token: weight-only int8 and bf16 copies of a model, for the tiers below the verifier.

Every token is decided by the verifier (the target over the full KV cache), so a tier below it may run cheaper
weights or caches at no loss at all: a worse approximation only lowers its acceptance rate (TriForce,
arXiv 2404.11912, Sec. 4: tier 1 only has to be close to the target). The verifier's own dtype alone defines the
output distribution.

* ``int8``: weight-only, symmetric, per output channel (``w ~= scale[o] * q[o, i]`` with ``q`` in [-127, 127],
  ``scale = max_i |w[o, i]| / 127``), as in gpt-fast's and torchao's int8 weight-only schemes. The matmul is
  PyTorch's own ``aten._weight_int8pack_mm`` (bf16 activations, int8 weights, fp32 accumulation) where the device
  has it; elsewhere ``x @ (q * scale)^T`` dequantized on the fly (feature detection with a fallback).
* ``bfloat16``: weights (out, in) in bf16 through ``F.linear``.

Activations stay in the source model's dtype between layers; each quantized matmul converts its input and output.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .model import Linear, Transformer

LOWER_WEIGHTS = ("int8", "bfloat16")


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
        linear: the :class:`~triforce.model.Linear` to quantize (its ``weight_t`` is (in, out)).

    Attributes:
        q: (out, in) int8. scale: (out,) bf16. bias: (out,) in the source dtype, or None.
    """

    def __init__(self, linear: Linear) -> None:
        super().__init__()
        w = linear.weight_t.detach().float().T  # (out, in)
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)  # (out,)
        self.q = nn.Parameter(torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous(),
                              requires_grad=False)
        self.scale = nn.Parameter(scale.to(torch.bfloat16), requires_grad=False)
        self.bias = linear.bias
        self.fast = _int8pack_supported(self.q.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # (M, in)
        if self.fast:
            y = torch.ops.aten._weight_int8pack_mm(x2.to(torch.bfloat16).contiguous(), self.q, self.scale)
        else:
            y = F.linear(x2, self.q.to(x2.dtype)) * self.scale.to(x2.dtype)
        y = y.to(x.dtype).reshape(*shape[:-1], -1)
        return y + self.bias if self.bias is not None else y


class BF16Linear(nn.Module):
    """``y = x W^T + b`` with W (out, in) in bf16 (``F.linear``'s layout, the faster one for bf16 GEMV on CPU)."""

    def __init__(self, linear: Linear) -> None:
        super().__init__()
        self.weight = nn.Parameter(linear.weight_t.detach().T.to(torch.bfloat16).contiguous(), requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x.to(torch.bfloat16), self.weight).to(x.dtype)
        return y + self.bias if self.bias is not None else y


def lower_precision_copy(model: Transformer, weights: str) -> Transformer:
    """A copy of ``model`` whose projections and LM head use ``weights`` (``int8`` or ``bfloat16``).

    Norms, RoPE and (for untied models) the embedding table are shared with ``model``, not copied; tied embeddings
    keep reading the source LM head's matrix. The copy is for speculation tiers below the verifier. When ``model``
    was compiled (:meth:`~triforce.model.Transformer.compile_blocks`), each copied MLP gets its own compiled forward:
    the source's compiled forward is bound to the source's full-precision MLP and must not travel with the copy.

    Args:
        model: the source model (any dtype, one rank's shard under tensor parallelism included).
        weights: one of :data:`LOWER_WEIGHTS`.

    Returns:
        a :class:`~triforce.model.Transformer` with attribute ``weights`` naming the scheme.

    Raises:
        ValueError: an unknown ``weights`` value (the allowed ones are in the message).
    """
    if weights not in LOWER_WEIGHTS:
        raise ValueError(f"lower_weights must be one of {', '.join(LOWER_WEIGHTS)}, got {weights!r}")
    make = Int8Linear if weights == "int8" else BF16Linear
    import copy

    out = copy.copy(model)  # shallow: shares submodules until replaced below
    out._modules = dict(model._modules)
    out._parameters = dict(model._parameters)
    out._buffers = dict(model._buffers)
    out.tied_embedding = model.lm_head.weight_t if model.embed_tokens is None else None
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
            mlp.forward = torch.compile(mlp.forward, mode=model.compile_mode, dynamic=False)
        b.self_attn, b.mlp = attn, mlp
        layers.append(b)
    out.layers = nn.ModuleList(layers)
    out.weights = weights
    return out
