"""The batched cost model: MagicDec's roofline analysis of speculative decoding at batch > 1 (Chen et al., "MagicDec:
Breaking the Latency-Throughput Tradeoff for Long Context Generation with Speculative Decoding", arXiv 2408.11049,
Sec. 3): at long context each sequence's KV cache is read once per step while the weights are read once for the
whole batch, so decoding stays memory-bound up to large batches and speculation pays more as the batch grows.
``bench/analysis/batching_model.py`` tabulates it for this project's machines."""

from __future__ import annotations

from .costmodel import _check_int, expected_tokens


def batch_step_seconds(batch: int, rows: int, weight_bytes: float, kv_slots: int, *, kv_bytes_per_slot: float,
                       flops_per_row: float, bandwidth: float, flops: float) -> float:
    """Roofline time of one forward over ``batch`` sequences of ``rows`` tokens each, seconds.

    The weights are read once for the whole batch, each sequence's KV once (``kv_slots`` positions of
    ``kv_bytes_per_slot`` bytes, every layer), and every row costs ``flops_per_row``; the step takes the longer of
    its bytes at ``bandwidth`` (bytes/s) and its FLOPs at ``flops`` (FLOP/s). This is the batched regime of
    MagicDec (Chen et al., arXiv 2408.11049, Sec. 3): at long context the KV bytes grow with the batch while the
    weight bytes do not, so decoding stays memory-bound up to large batches.

    Raises:
        ValueError: a count below 1 or a rate that is not positive.
    """
    for name, v in (("batch", batch), ("rows", rows)):
        _check_int(name, v, 1)
    if not (bandwidth > 0 and flops > 0):
        raise ValueError(f"bandwidth and flops must be > 0, got {bandwidth!r}, {flops!r}")
    memory = (weight_bytes + batch * kv_slots * kv_bytes_per_slot) / bandwidth
    compute = batch * rows * flops_per_row / flops
    return max(memory, compute)


def predict_batch(batch: int, context: int, gamma: int, acceptance: float, draft_slots: int, *, weight_bytes: float,
                  kv_bytes_per_slot: float, flops_per_row: float, bandwidth: float, flops: float,
                  draft_weight_bytes: float | None = None) -> dict:
    """Predicted speedup of self-speculation with a sparse KV cache over batched autoregressive decoding.

    The drafter is the target's own weights over ``draft_slots`` KV positions (TriForce's retrieval tier, or
    MagicDec's StreamingLLM self-draft); each of the ``batch`` sequences drafts ``gamma`` tokens, then one verifier
    forward checks every sequence's ``gamma + 1`` rows over its full ``context``. With
    ``t(B, T, S)`` = :func:`batch_step_seconds` over B sequences of T rows and S KV slots::

        autoregressive: B tokens per t(B, 1, context)
        speculative:    B * E tokens per gamma * t(B, 1, draft_slots) + t(B, gamma + 1, context)
        E = expected_tokens(acceptance, gamma)   (Leviathan et al., arXiv 2211.17192, Eq. 1)

    MagicDec (arXiv 2408.11049, Sec. 3-4): the speedup grows with the batch at long context (the KV the draft
    skips dominates), and shrinks at short context, where the verifier's gamma + 1 rows per sequence make it
    compute-bound. ``draft_weight_bytes`` (default ``weight_bytes``) is the drafter's copy of the weights (int8:
    a quarter of fp32's); its KV slots have ``kv_bytes_per_slot`` bytes too.

    Returns:
        ``{"batch", "context", "gamma", "expected_tokens", "autoregressive_step_seconds", "draft_step_seconds",
        "verify_seconds", "autoregressive_tokens_per_second", "speculative_tokens_per_second", "speedup"}``.

    Raises:
        ValueError: see :func:`batch_step_seconds` and :func:`expected_tokens`.
    """
    kw = dict(kv_bytes_per_slot=kv_bytes_per_slot, flops_per_row=flops_per_row, bandwidth=bandwidth, flops=flops)
    e = expected_tokens(acceptance, gamma)
    ar = batch_step_seconds(batch, 1, weight_bytes, context, **kw)
    draft = batch_step_seconds(batch, 1, weight_bytes if draft_weight_bytes is None else draft_weight_bytes,
                               min(draft_slots, context), **kw)
    verify = batch_step_seconds(batch, gamma + 1, weight_bytes, context + gamma, **kw)
    ar_tps = batch / ar
    spec_tps = batch * e / (gamma * draft + verify)
    return dict(batch=batch, context=context, gamma=gamma, expected_tokens=e, autoregressive_step_seconds=ar,
                draft_step_seconds=draft, verify_seconds=verify, autoregressive_tokens_per_second=ar_tps,
                speculative_tokens_per_second=spec_tps, speedup=spec_tps / ar_tps)


__all__ = ["batch_step_seconds", "predict_batch"]
