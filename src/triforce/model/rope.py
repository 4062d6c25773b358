"""Rotary position embeddings (RoPE) and the scaling variants Llama-family checkpoints use.

Source: Su et al., "RoFormer" (arXiv 2104.09864) for RoPE; linear position interpolation (Chen et al.,
arXiv 2306.15595); dynamic NTK (bloc97/emozilla, as in transformers' ``_compute_dynamic_ntk_parameters``);
YaRN (Peng et al., arXiv 2309.00071, as used by Yarn-Llama-2-7b-128k); Llama 3.1 frequency smoothing
(Meta's reference code). The formulas follow transformers' ``modeling_rope_utils`` so logits match.

Convention: the "rotate half" layout of Hugging Face checkpoints (GGUF files are converted to it by
transformers' reader).

Dynamic NTK past the original context: Hugging Face rescales the frequencies whenever the sequence grows past
its previous maximum, so keys cached early and queries computed later use different frequencies. We instead
fix the scaling once per request from the request's total length (prompt + new tokens: not the speculation block,
whose size depends on the mode, so that every mode runs the same model),
``seq_len = max(total_length, max_position_embeddings)``, and use it for every key and query of that request.
Within ``max_position_embeddings`` this is plain RoPE, exactly as in transformers.
"""

from __future__ import annotations

import math

import torch

from .config import ModelConfig


def rope_inv_freq(cfg: ModelConfig, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scale ("attention factor") for a config's RoPE variant.

    Args:
        cfg: model configuration; ``cfg.rope_parameters['rope_type']`` selects the variant.
        seq_len: total tokens of the request, used by dynamic NTK only.

    Returns:
        ``(inv_freq, attention_factor)``: inv_freq is fp32 of shape ``(head_dim // 2,)`` in radians per
        position; attention_factor multiplies cos and sin (YaRN's mscale; 1.0 otherwise).

    Raises:
        ValueError: a RoPE type outside ``default, linear, dynamic, yarn, llama3``.
    """
    p = cfg.rope_parameters
    rope_type = cfg.rope_type
    base = float(p.get("rope_theta", 10000.0))
    dim = cfg.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (base**exponents)
    factor = p.get("factor")
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / float(factor), 1.0
    if rope_type == "dynamic":
        max_pos = cfg.max_position_embeddings
        n = max(seq_len or max_pos, max_pos)
        base = base * ((float(factor) * n / max_pos) - (float(factor) - 1)) ** (dim / (dim - 2))
        return 1.0 / (base**exponents), 1.0
    if rope_type == "yarn":
        return _yarn(cfg, base, dim)
    if rope_type == "llama3":
        factor = float(factor)
        low, high = float(p["low_freq_factor"]), float(p["high_freq_factor"])
        old_ctx = float(p["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    raise ValueError(f"unsupported rope_type {rope_type!r}; supported: default, linear, dynamic, yarn, llama3")


def _yarn(cfg: ModelConfig, base: float, dim: int) -> tuple[torch.Tensor, float]:
    """YaRN: blend interpolated and extrapolated frequencies by wavelength, scale cos/sin by mscale."""
    p = cfg.rope_parameters
    original = int(p.get("original_max_position_embeddings") or cfg.max_position_embeddings)
    factor = p.get("factor") or cfg.max_position_embeddings / original
    factor = float(factor)

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = p.get("beta_fast") or 32
    beta_slow = p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_weight = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight
    return inv_freq, float(attention_factor)


class RotaryEmbedding:
    """Computes cos/sin for arbitrary absolute positions and rotates queries and keys.

    Positions may be any integers (including negative, used to re-rotate a query by a position offset), so
    caches that keep only a subset of positions still rotate every token at its true position.

    Args:
        cfg: model configuration.
        seq_len: total tokens of the request (only dynamic NTK uses it; see the module docstring).
        device: where cos/sin are produced.
    """

    def __init__(self, cfg: ModelConfig, seq_len: int | None = None, device: torch.device | str = "cpu") -> None:
        inv_freq, self.attention_factor = rope_inv_freq(cfg, seq_len)
        self.seq_len = seq_len  # the request length the frequencies were made for (only dynamic NTK's depend on it)
        self.inv_freq = inv_freq.to(device)  # (hs/2,) fp32

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for ``positions`` (T,) int64 -> two tensors of shape (T, hs) in ``dtype``, computed in fp32."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]  # (T, hs/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, hs)
        return (emb.cos() * self.attention_factor).to(dtype), (emb.sin() * self.attention_factor).to(dtype)
