"""Attention through PyTorch's ``scaled_dot_product_attention`` (SDPA), where our CPU kernel (``kernels/cpu.py``) does
not apply: grouped-query attention under a boolean mask (prefill, the streaming and retrieval caches, every device),
and a block that ends the sequence under PyTorch's lower-right causal bias, which lets SDPA use its flash kernels on
CUDA (the full KV cache's verification blocks and prefill there).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Scaled dot-product attention (Vaswani et al., arXiv 1706.03762) with grouped-query heads (Ainslie et al.,
    arXiv 2305.13245), without materialising repeated keys: the g = nh / nkv query heads of a KV head are stacked
    along time, so one SDPA call per KV head reads its keys once.

    Args:
        q: (B, nh, T, hs) queries.
        k, v: (B, nkv, S, hs) keys and values; nh % nkv == 0.
        mask: None (every key visible) or bool (T, S) / (B, nkv, T, S), True = visible.

    Returns:
        (B, nh, T, hs), same dtype as q. Softmax in the kernel's precision (fp32 accumulation on CPU). Keys and
        values stored in another dtype (a cheaper cache of a lower tier) are attended in their dtype.
    """
    if k.dtype != q.dtype:
        return gqa_attention(q.to(k.dtype), k, v, mask).to(q.dtype)
    b, nh, t, hs = q.shape
    nkv = k.shape[1]
    g = nh // nkv
    qg = q.reshape(b, nkv, g * t, hs)  # (B, nkv, g*T, hs): the g heads of one KV head stacked along time
    if mask is not None:
        mask = mask.unsqueeze(-3).expand(*mask.shape[:-2], g, *mask.shape[-2:])
        mask = mask.reshape(*mask.shape[:-3], g * t, mask.shape[-1])
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask)
    return out.view(b, nh, t, hs)


#: devices and dtypes where :func:`lower_right_attention` applies (tests widen them to run its code on a CPU)
LOWER_RIGHT_DEVICES = ("cuda",)
LOWER_RIGHT_DTYPES = (torch.float16, torch.bfloat16)


def lower_right_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_keys: int) -> torch.Tensor | None:
    """The attention of :func:`triforce.kernels.cpu.gqa_attention_kernel` (a block of T >= 2 queries that ends the
    sequence, query i seeing keys j <= n_keys - T + i) through SDPA with PyTorch's lower-right causal bias, or None.

    The full KV cache's boolean (T, n_keys) mask rules out SDPA's flash kernel on CUDA and makes the others read a
    mask; the lower-right causal bias (``torch.nn.attention.bias.causal_lower_right``: the same visibility, nothing
    materialised; the bottom-right aligned causal mask flash-attn uses since its version 2.1, FlashAttention-2:
    Dao, arXiv 2307.08691) lets SDPA run its flash or memory-efficient kernel with the causal structure built in
    (faster on a GPU, measured by an earlier version: docs/performance.md, "GPU: one H200"). This function itself
    has not run on a GPU yet.

    Args:
        q: (B, nh, T, hs) queries (after RoPE).
        k, v: (B, nkv, capacity, hs) one layer's cache, capacity >= n_keys.
        n_keys: keys the block sees, the cache length after this block's tokens were written.

    Returns:
        (B, nh, T, hs) in q's dtype, or None where it does not apply: a device not in :data:`LOWER_RIGHT_DEVICES`, a
        dtype not in :data:`LOWER_RIGHT_DTYPES` (flash kernels take half precision only), grouped-query heads
        (nkv < nh: measured with MHA only), T < 2 (a decode step has no mask), or shapes that do not match.
    """
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        return None
    b, nh, t, hs = q.shape
    if (q.device.type not in LOWER_RIGHT_DEVICES or q.dtype not in LOWER_RIGHT_DTYPES or k.dtype != q.dtype
            or v.dtype != q.dtype or k.shape[:2] != (b, nh) or k.shape[3] != hs or not 2 <= t <= n_keys <= k.shape[2]):
        return None
    from torch.nn.attention.bias import causal_lower_right

    return F.scaled_dot_product_attention(q, k[:, :, :n_keys], v[:, :, :n_keys],
                                          attn_mask=causal_lower_right(t, n_keys))
