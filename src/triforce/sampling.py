"""Sampling: turning logits into the distribution a token is drawn from, identically in every tier.

Losslessness needs q and p to be exactly the distributions sampled from (TriForce notes; Leviathan et al.
2023, Sec. 2.3): every tier applies the same :func:`logits_to_probs` (temperature, then top-k, then top-p, as
transformers' logits warpers do) in fp32. Greedy decoding (temperature 0) is the one-hot distribution on the
argmax (first index on ties), so the rejection rule reduces to "accept iff the draft equals the argmax".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .defaults import DEFAULTS


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are drawn.

    Attributes:
        temperature: >= 0; 0 means greedy (argmax).
        top_p: nucleus mass in (0, 1]; 1 disables it (Holtzman et al., arXiv 1904.09751).
        top_k: keep the k most likely tokens; 0 disables it.

    Raises:
        ValueError: (on construction) a value outside the ranges above, naming the parameter.
    """

    temperature: float = DEFAULTS["temperature"]
    top_p: float = DEFAULTS["top_p"]
    top_k: int = DEFAULTS["top_k"]

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = disabled), got {self.top_k!r}")

    @property
    def greedy(self) -> bool:
        """Temperature 0: the argmax is taken."""
        return self.temperature == 0


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution tokens are sampled from, computed in fp32.

    Args:
        logits: (..., V) any float dtype.
        params: sampling parameters.

    Returns:
        (..., V) fp32 probabilities summing to 1; one-hot on the argmax when ``params.greedy``.
    """
    logits = logits.float()
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        remove_sorted = cumulative <= 1 - params.top_p
        remove_sorted[..., -1] = False  # always keep the most likely token
        remove = remove_sorted.scatter(-1, order, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return torch.softmax(logits, dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one token per row from ``probs`` (N, V) fp32 -> (N,) int64."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
