"""Log-probabilities of the tokens a request emits (and of its prompt), from the verifier's logits.

The values are the target model's own distribution: ``log_softmax`` of the verifier's fp32 logits at temperature 1,
before temperature, top-k and top-p (vLLM's default ``raw_logprobs``, as OpenAI's ``logprobs``). A verification
block's rows are the rows a decode step computes (docs/architecture.md, "The exactness rule"), so every mode reports
plain autoregressive decoding's values. Prompt log-probabilities (``echo`` on ``/v1/completions``) take one extra
pass of the target over the prompt (:func:`prompt_logprobs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

#: the most alternatives a request may ask for per token (OpenAI's ``top_logprobs`` limit)
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability under the target model and its most likely alternatives.

    Attributes:
        token_id: the token (emitted, or a prompt token).
        logprob: natural log of its probability, fp32 rounded to a Python float (<= 0).
        top: ``(token_id, logprob)`` of the ``top_logprobs`` most likely tokens at that position, most likely first
            (ties: the lower id first); empty when none were asked for.
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    def to_dict(self) -> dict:
        """``{"token_id", "logprob", "top_logprobs": [{"token_id", "logprob"}, ...]}`` (``--json``)."""
        return {"token_id": self.token_id, "logprob": self.logprob,
                "top_logprobs": [{"token_id": t, "logprob": lp} for t, lp in self.top]}


def check_top_logprobs(value, name: str = "logprobs") -> None:
    """``value`` is None (no log-probabilities) or an integer in [0, :data:`MAX_TOP_LOGPROBS`].

    Raises:
        ValueError: naming ``name`` and the allowed values.
    """
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or not 0 <= value <= MAX_TOP_LOGPROBS):
        raise ValueError(f"{name} must be an integer in [0, {MAX_TOP_LOGPROBS}] (alternatives per token), "
                         f"got {value!r}")


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """The log-probabilities of ``tokens`` under the rows of ``logits`` that predicted them.

    Args:
        logits: (n, V) any float dtype: row i is the distribution ``tokens[i]`` was drawn from (n >= len(tokens)).
        tokens: the tokens, one per row.
        top: alternatives per token, >= 0.

    Returns:
        one :class:`TokenLogprob` per token: ``log_softmax`` in fp32 (module docstring).
    """
    n = len(tokens)
    if not n:
        return []
    assert logits.dim() == 2 and logits.shape[0] >= n, f"logits {tuple(logits.shape)} for {n} tokens"
    lp = torch.log_softmax(logits[:n].float(), dim=-1)  # (n, V)
    chosen = lp.gather(-1, torch.tensor(tokens, device=lp.device)[:, None])[:, 0].tolist()
    alts: list[tuple] = [()] * n
    if top:
        vals, ids = torch.topk(lp, top, dim=-1)  # (n, top), most likely first
        alts = [tuple(sorted(zip(i, v), key=lambda a: (-a[1], a[0])))  # ties: the lower id first
                for i, v in zip(ids.tolist(), vals.tolist())]
    return [TokenLogprob(t, c, a) for t, c, a in zip(tokens, chosen, alts)]


@torch.inference_mode()
def prompt_logprobs(model, prompt_ids: list[int], top: int, chunk: int = 512,
                    progress: Callable[[int], None] | None = None) -> list[TokenLogprob | None]:
    """Log-probabilities of every prompt token given the ones before it (the first has none), from a pass of
    ``model`` over the prompt into a KV cache of its own (the model's weights, fp32 logits). The caller checks the
    prompt first (vocabulary, context, memory: :meth:`~triforce.api.TriForce.prompt_logprobs`).

    Args:
        model: a :class:`~triforce.model.transformer.Transformer` (the target), not with dynamic NTK RoPE (its
            frequencies depend on a request's length, and the model's are the running request's).
        prompt_ids: the prompt, >= 1 token.
        top: alternatives per token, >= 0.
        chunk: tokens per forward (fewer beside running generations, ``model.batching.prefill_chunk``); only one
            chunk's logits are held at a time ((chunk, V) fp32).
        progress: called with the tokens of each chunk once it is done (it may raise to stop the pass).

    Returns:
        ``[None, TokenLogprob(prompt_ids[1]), ...]``, one entry per prompt token.

    Raises:
        ValueError: a model with dynamic NTK RoPE.
    """
    from ..kv.caches import FullKVCache
    from ..model.batching import prefill_chunk, run_forward

    if model.cfg.rope_type == "dynamic":
        raise ValueError("prompt log-probabilities are not available for a model with dynamic NTK RoPE scaling (its "
                         "keys depend on the request's length)")
    n = len(prompt_ids)
    cache = FullKVCache(model.cfg, n, model.dtype, model.device)
    out: list[TokenLogprob | None] = [None]
    start = 0
    while start < n - 1:  # the last token predicts nothing in the prompt
        ids = prompt_ids[start:min(n - 1, start + prefill_chunk(chunk))]  # smaller beside running generations
        x = torch.tensor([ids], dtype=torch.long, device=model.device)
        pos = torch.arange(start, start + len(ids), device=model.device)
        logits = run_forward(model, x, pos, cache)[0][0]  # (len(ids), V); batched under the server's scheduler
        out += token_logprobs(logits, prompt_ids[start + 1:start + 1 + len(ids)], top)
        start += len(ids)
        if progress is not None:
            progress(len(ids))
    return out
