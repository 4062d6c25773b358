"""The verifier's arithmetic: ``exact`` (fp32 products over the weights the checkpoint stands for) or ``file`` (a
GGUF file's own arithmetic: its block codes times int8-quantized activations, as llama.cpp computes them).

``exact`` computes the model transformers computes from the same checkpoint (fp32 logits within 1e-4 of
transformers'). ``file`` computes the model a GGUF file's users run: every product whose codes the integer kernel
takes (:attr:`~triforce.kernels.codes.BlockCodes.q8_dot_ok`: Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K and their
fusions) quantizes each activation row to int8 per block of 32 inputs and sums integer dot products with the codes
(:func:`~triforce.kernels.blockcodes.blockcode_linear_q8`; llama.cpp's ``ggml-quants.c``), in decode steps,
verification blocks, batched steps, prefill and the LM head alike, so prefill and decoding are one model. Its rows are
row-invariant by construction (each row's integers and float steps depend on that row alone, on every build), so
TriForce's exactness rule holds on it as on ``exact`` (:mod:`triforce.kernels.rows`): every speculative mode gives
the tokens plain decoding gives, and sampling keeps the verifier's distribution (arXiv 2404.11912, Sec. 4). The
speculation is lossless with respect to the verifier, whichever arithmetic the verifier computes.
"""

from __future__ import annotations

from ..defaults import PRECISIONS
from .transformer import Linear, Transformer


def check_precision(precision: str | None) -> None:
    """Raise before any work for a ``precision`` that is not None or one of :data:`~triforce.defaults.PRECISIONS`.

    Raises:
        ValueError: naming the parameter and the allowed values.
    """
    if precision is not None and precision not in PRECISIONS:
        raise ValueError(f"precision must be None (chosen by the model) or one of {', '.join(PRECISIONS)}, "
                         f"got {precision!r}")


def file_arithmetic_ok(model: Transformer) -> bool:
    """Whether ``model`` can run on its file's arithmetic: a projection with block codes the integer kernel takes."""
    return any(isinstance(m, Linear) and m.codes is not None and m.codes.bits != 16 and m.codes.q8_dot_ok
               for m in model.modules())


def set_precision(model: Transformer, precision: str | None) -> str:
    """Make ``model`` compute on ``precision`` and record it as ``model.precision``.

    Args:
        model: a loaded model, its block codes attached
            (:meth:`~triforce.model.transformer.Transformer.attach_block_codes`).
        precision: ``"file"``, ``"exact"``, or None: ``file`` where the model has block codes the integer kernel
            takes (a GGUF file on the CPU in fp32), else ``exact``.

    Returns:
        the precision the model now computes on.

    Raises:
        ValueError: an unknown ``precision``; ``"file"`` for a model without such codes (a Hugging Face checkpoint, a
            GGUF file loaded in another dtype or off the CPU, or the block-code kernel off), naming why.
    """
    check_precision(precision)
    ok = file_arithmetic_ok(model)
    if precision == "file" and not ok:
        raise ValueError("precision='file' needs a GGUF file's block codes on the CPU in fp32 (dtype float32, device "
                         "cpu, the block-code kernel on); this model has none: use precision='exact'")
    chosen = precision or ("file" if ok else "exact")
    for module in model.modules():
        if isinstance(module, Linear) and module.codes is not None and module.codes.bits != 16:
            module.q8 = chosen == "file" and module.codes.q8_dot_ok
    if getattr(model, "decode_step", None) is not None:  # its one-call step reads each weight's arithmetic once
        from ..kernels.decode_step import DecodeStep

        model.decode_step = DecodeStep(model)
    model.precision = chosen
    return chosen
