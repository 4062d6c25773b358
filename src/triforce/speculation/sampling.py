"""Sampling: turning logits into the distribution a token is drawn from, identically in every tier.

Losslessness needs q and p to be exactly the distributions sampled from (TriForce notes; Leviathan et al.
2023, Sec. 2.3): every tier applies the same :func:`logits_to_probs` (temperature, then top-k, then top-p, as
transformers' logits warpers do) in fp32. Greedy decoding (temperature 0) is the one-hot distribution on the
argmax (first index on ties), so the rejection rule reduces to "accept iff the draft equals the argmax".

The nucleus selection and the inverse-CDF draw run in ``csrc/sampling.c`` where it builds (one pass over the row
each instead of PyTorch's topk, cumsum, scatter and checks; its time: docs/performance.md, "Kernels (EPYC)"),
PyTorch's ops otherwise (``TRIFORCE_SAMPLING_KERNEL=0``, no compiler; without AVX2 its portable build runs): the
same rule, the same support, probabilities equal up to the rounding of the renormalisation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..defaults import DEFAULTS
from ..kernels.sampling import sampling_kernel
from .logprobs import check_top_logprobs


def _kernel_rows(x: torch.Tensor) -> dict | None:
    """The sampling kernel's functions where they apply to ``x`` (2-D, contiguous fp32 on the CPU), else None."""
    if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu" or not x.is_contiguous() or not x.numel():
        return None
    return sampling_kernel()


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are drawn.

    Attributes:
        temperature: >= 0; 0 means greedy (argmax).
        top_p: nucleus mass in (0, 1]; 1 disables it (Holtzman et al., arXiv 1904.09751).
        top_k: keep the k most likely tokens; 0 disables it.
        logprobs: None, or report each emitted token's log-probability under the target model with this many most
            likely alternatives (0 to :data:`~triforce.speculation.logprobs.MAX_TOP_LOGPROBS`;
            ``speculation/logprobs.py``). An output option, as vLLM's ``SamplingParams.logprobs``: it never changes
            which tokens are drawn.

    Raises:
        ValueError: (on construction) a value outside the ranges above, naming the parameter.
    """

    temperature: float = DEFAULTS["temperature"]
    top_p: float = DEFAULTS["top_p"]
    top_k: int = DEFAULTS["top_k"]
    logprobs: int | None = None

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = disabled), got {self.top_k!r}")
        check_top_logprobs(self.logprobs)

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
        return _nucleus(logits, params.top_p)
    return torch.softmax(logits, dim=-1)


#: candidates the nucleus is looked for among first (``torch.topk``); rows whose nucleus is larger sort everything
NUCLEUS_CANDIDATES = 128


def _nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Top-p (nucleus) sampling's distribution: softmax over the smallest set of most likely tokens with mass >= top_p.

    The rule of transformers' ``TopPLogitsWarper`` (Holtzman et al., arXiv 1904.09751): sorted ascending, a token is
    removed when the cumulative mass up to and including it is <= 1 - top_p, the most likely token always kept;
    equivalently, a token stays iff the mass of the tokens ranked above it is < top_p. The nucleus is almost always
    among the :data:`NUCLEUS_CANDIDATES` most likely tokens: ``csrc/sampling.c`` finds it in one pass over the row
    (ties ranked by the lower index; the mass above each candidate rounded as the PyTorch path rounds it, so both keep
    the same tokens), or else ``torch.topk`` finds those candidates; only rows whose nucleus is larger sort their
    whole vocabulary, each row on its own (the result of a row does not depend on the rows beside it); the three
    paths' times: docs/performance.md, "Kernels (EPYC)". Rounding at the boundary may differ from transformers' in
    the last bit of the cumulative mass; every tier applies this same function, so the verified distribution is the
    one it defines.

    Args:
        logits: (..., V) fp32, already divided by the temperature (and top-k masked with -inf).
        top_p: nucleus mass in (0, 1).

    Returns:
        (..., V) fp32 probabilities summing to 1, zero outside the nucleus.
    """
    shape = logits.shape
    logits = logits.reshape(-1, shape[-1])  # (N, V)
    probs = torch.softmax(logits, dim=-1)
    fns = _kernel_rows(probs)
    if fns is not None:  # csrc/sampling.c: the same rule in place, one pass over each row
        work = torch.empty(shape[-1], dtype=torch.int32)
        left = torch.empty(probs.shape[0], dtype=torch.uint8)  # rows it leaves: a nucleus over the candidates, NaN
        n_left = fns["triforce_top_p"](probs.data_ptr(), probs.shape[0], probs.shape[1], top_p, NUCLEUS_CANDIDATES,
                                       work.data_ptr(), left.data_ptr())
        if n_left == 0:
            return probs.reshape(shape)
        if n_left > 0:
            rows = left.nonzero().squeeze(-1)
            probs[rows] = _nucleus_ops(logits[rows], probs[rows], top_p)
            return probs.reshape(shape)
    return _nucleus_ops(logits, probs, top_p).reshape(shape)


def _nucleus_ops(logits: torch.Tensor, probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """:func:`_nucleus` in PyTorch's ops for (N, V) ``logits`` and their softmax ``probs`` (not modified): the
    nucleus among the :data:`NUCLEUS_CANDIDATES` most likely tokens, or transformers' full sort where they hold less
    than ``top_p``; (N, V) fp32."""
    top, order = torch.topk(probs, min(NUCLEUS_CANDIDATES, probs.shape[-1]), dim=-1)  # (N, k) descending
    keep = (top.cumsum(-1) - top) < top_p  # the mass ranked above each candidate is below top_p
    keep[:, 0] = True  # the most likely token always stays
    kept = top * keep
    out = torch.zeros_like(probs).scatter_(-1, order, kept / kept.sum(-1, keepdim=True))
    found = top.sum(-1) >= top_p  # (N,): every token outside the candidates has mass >= top_p above it
    if not bool(found.all()):
        rows = (~found).nonzero().squeeze(-1)
        sub = logits[rows]
        sorted_logits, order_all = torch.sort(sub, dim=-1, descending=False)
        remove_sorted = sorted_logits.softmax(-1).cumsum(-1) <= 1 - top_p
        remove_sorted[:, -1] = False  # always keep the most likely token
        remove = remove_sorted.scatter(-1, order_all, remove_sorted)
        out[rows] = torch.softmax(sub.masked_fill(remove, float("-inf")), dim=-1)
    return out


_NOT_A_DISTRIBUTION = ("probs: every row must be non-negative with a positive, finite sum (got a row of zeros, a "
                       "negative entry, NaN or inf)")


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one token per row from ``probs`` by inversion of its cumulative distribution.

    Token i is drawn when ``u * c[V-1]`` falls in ``[c[i-1], c[i])``, with ``c`` the row's cumulative sums (fp64)
    and ``u`` one uniform in [0, 1) from ``generator``: exactly probability ``probs[i] / sum(probs)``, and never a
    token of probability 0 (its interval is empty). Equivalent in distribution to ``torch.multinomial(probs, 1)``,
    and faster (docs/performance.md, "Kernels (EPYC)"); ``csrc/sampling.c`` skips runs of zero weights and draws the
    same token for the same uniform as PyTorch's ops. The draws for a given seed differ from multinomial's.

    Args:
        probs: (N, V) non-negative weights (fp32), each row with a positive sum (normalised or not).
        generator: random source (one uniform per row).

    Returns:
        (N,) int64 token ids.

    Raises:
        ValueError: ``probs`` not (N, V) with V >= 1, or a row with a negative entry or whose sum is not positive
            and finite (all zeros, NaN or inf: e.g. overflowed logits), as ``torch.multinomial`` refuses them.
    """
    if probs.dim() != 2 or probs.shape[-1] < 1:
        raise ValueError(f"probs must be (N, V) with V >= 1, got shape {tuple(probs.shape)}")
    fns = _kernel_rows(probs)
    if fns is not None:  # csrc/sampling.c: the same draw, skipping runs of zeros; rows checked before u is drawn
        n, v = probs.shape
        total, out = torch.empty(n, dtype=torch.float64), torch.empty(n, dtype=torch.int64)
        if fns["triforce_sample"](probs.data_ptr(), None, None, n, v, total.data_ptr()):
            raise ValueError(_NOT_A_DISTRIBUTION)
        u = torch.rand(n, generator=generator, dtype=torch.float64)
        fns["triforce_sample"](probs.data_ptr(), u.data_ptr(), out.data_ptr(), n, v, total.data_ptr())
        return out
    c = probs.double().cumsum(-1)  # (N, V)
    total = c[:, -1]
    if not bool(((total > 0) & torch.isfinite(total)).all()) or not bool((probs >= 0).all()):
        raise ValueError(_NOT_A_DISTRIBUTION)
    u = torch.rand((probs.shape[0], 1), generator=generator, device=probs.device, dtype=torch.float64)
    return torch.searchsorted(c, u * c[:, -1:], right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)
