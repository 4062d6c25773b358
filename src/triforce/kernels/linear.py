"""The product dispatcher: which kernel computes each :class:`~triforce.model.transformer.Linear`'s ``y = x W + b``.

A pure function of its arguments: the caller says whether the rows must be row-invariant (``rows_exact``, read from
:func:`~triforce.kernels.rows.exact_rows` by the model's Linear); the rule itself is :mod:`triforce.kernels.rows`'.
"""

from __future__ import annotations

import os
from typing import Callable

import torch

from .blockcodes import blockcode_linear, blockcode_linear_q8, blockcode_matmul
from .cpu import (
    F32_MAX_ROWS,
    LINEAR_MAX_ROWS,
    ONE_ROW_ENV_SWITCH,
    f32_beats_onednn,
    f32_linear,
    f32_one_row_exact,
    f32_one_row_pays,
)


def _chunks(fn: Callable, x: torch.Tensor, w, rows: int = LINEAR_MAX_ROWS) -> torch.Tensor | None:
    """``fn(x, w)`` over chunks of at most ``rows`` rows of ``x`` (M, in), concatenated; None where ``fn`` gives None
    for one (the kernel does not apply)."""
    if x.shape[0] <= rows:
        return fn(x, w)
    parts = []
    for i in range(0, x.shape[0], rows):
        part = fn(x[i:i + rows], w)
        if part is None:
            return None
        parts.append(part)
    return torch.cat(parts)


def _rowwise(fn: Callable, x: torch.Tensor, w) -> torch.Tensor:
    """``fn`` on each row of ``x`` (M, in) alone, as a fresh (1, in) tensor (what a decode step passes), stacked."""
    return torch.cat([fn(x[i:i + 1].clone(), w) for i in range(x.shape[0])])


def linear_forward(lin, x: torch.Tensor, rows_exact: bool) -> torch.Tensor:
    """``y = x W + b`` for a :class:`~triforce.model.transformer.Linear`, on the path its rows need.

    A Linear with ``q8`` set (the file's arithmetic, :mod:`triforce.model.precision`; a lower tier's copy) takes the
    integer dot products for any number of rows, in chunks of ``LINEAR_MAX_ROWS`` (each row's value is its own, so
    prefill and decode steps compute one model). Otherwise, with ``rows_exact`` on the CPU in fp32
    (:mod:`triforce.kernels.rows`): block codes or our fp32 kernel for any number
    of rows, in chunks of ``LINEAR_MAX_ROWS``; where neither kernel applies, one PyTorch product per row. Otherwise the
    fastest path by rows: block codes (up to ``LINEAR_MAX_ROWS`` rows, else dequantized tiles); our fp32 kernel for
    2-64 rows unless oneDNN's packed product is faster on this build (:func:`~triforce.kernels.cpu.f32_beats_onednn`),
    and for one row where :func:`~triforce.kernels.cpu.f32_one_row_pays`; else oneDNN over packed weights, else MKL.

    Args:
        lin: the Linear: ``weight_t`` (in, out) or None (codes only), ``bias`` (out,) or None, ``codes``
            (:class:`~triforce.kernels.codes.BlockCodes`) or None, ``q8`` (bool), ``packed`` (oneDNN's copy) or None.
        x: (..., in) activations.
        rows_exact: whether each row must round as it does alone (the verifier's decode steps and blocks,
            :func:`~triforce.kernels.rows.exact_rows`).

    Returns:
        (..., out), x's dtype (fp32 from the kernels).
    """
    rows = x.numel() // x.shape[-1]
    x2 = x.reshape(-1, x.shape[-1])
    exact = rows_exact and x.device.type == "cpu" and x.dtype == torch.float32 and rows > 0
    y = None  # our kernels' product where one applies (each gives None where it does not)
    if lin.codes is not None and lin.q8 and x.device.type == "cpu" and x.dtype == torch.float32 and rows > 0:
        # the file's arithmetic (model/precision.py) or a lower tier's copy, for any rows, prefill included: one model
        y = _chunks(blockcode_linear_q8, x2, lin.codes)  # None where the codes do not allow it
    if y is None and lin.codes is not None and (rows <= LINEAR_MAX_ROWS or exact):  # the fp32 weights, fewer bytes
        y = _chunks(blockcode_linear, x2, lin.codes)
    if y is None and exact:
        if lin.weight_t is None:  # codes only, their kernel off: the dequantized tiles' product, a row at a time
            y = _rowwise(blockcode_matmul, x2, lin.codes)
        elif rows > 1 or f32_one_row_exact():
            y = _chunks(f32_linear, x2, lin.weight_t, F32_MAX_ROWS)
        # the kernel off: each row as a decode step computes it (unless the A/B switch sends one row to MKL's GEMV)
        if y is None and not (rows == 1 and os.environ.get(ONE_ROW_ENV_SWITCH) == "0"):
            y = _rowwise(torch.matmul, x2, lin.weight_t)
    if y is None and lin.weight_t is None:  # codes only (a GGUF file read as stored): dequantized tiles
        y = blockcode_matmul(x2, lin.codes)
    if y is None and ((1 < rows <= LINEAR_MAX_ROWS and (lin.packed is None or f32_beats_onednn()))
                      or (rows == 1 and f32_one_row_pays())):
        y = f32_linear(x2, lin.weight_t)
    if y is not None:
        y = y.reshape(*x.shape[:-1], -1)
        return y + lin.bias if lin.bias is not None else y
    if lin.packed is not None and rows > 1:  # several rows: prefill
        y = torch.ops.mkldnn._linear_pointwise(x2, lin.packed, lin.bias, "none", [], "")
        return y.reshape(*x.shape[:-1], -1)
    y = x @ lin.weight_t
    return y + lin.bias if lin.bias is not None else y
