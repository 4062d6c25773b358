"""The verification rule of speculative sampling: which draft tokens are accepted and what comes next.

Source: Leviathan, Kalman, Matias, "Fast Inference from Transformers via Speculative Decoding" (ICML 2023,
Algorithm 1) and Chen et al., "Accelerating LLM Decoding with Speculative Sampling" (arXiv 2302.01318,
Algorithm 2); used at both verifying tiers of TriForce (arXiv 2404.11912, Algorithm 1).

Given k draft tokens x_1..x_k, each sampled from the drafter's distribution q_i, and the verifier's
distributions p_1..p_{k+1} at the same positions (plus one):

* **accepted tokens**: x_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)), in order, until the first
  rejection (implemented as ``u * q_i(x_i) < p_i(x_i)`` with u ~ U[0, 1)).
* **recovered token**: at the first rejected position j, the next token is drawn from the residual
  distribution ``norm(max(p_j - q_j, 0))``. Its mass is zero only when p_j <= q_j everywhere, i.e. p_j == q_j up
  to rounding, where rejection has probability zero; if rounding still rejects, we draw from p_j.
* **bonus token**: if all k are accepted, the next token is drawn from p_{k+1}.

The emitted tokens (accepted + recovered/bonus) are then distributed exactly as sampling from p, whatever q is,
as long as q is exactly the distribution x was drawn from. In a hierarchy the middle tier emits tokens
distributed as its own distribution, so the tier above may use that distribution as its q; this is why the
middle tier must draw recovered tokens from the residual too (the TriForce reference resamples from p there,
which is biased under sampling).

Greedy (temperature 0): x_i is accepted iff it equals argmax p_i; the next token is argmax p_j.
"""

from __future__ import annotations

import torch

from .sampling import sample


def rejection_sample(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
    greedy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify a batch of draft blocks.

    Args:
        draft_tokens: (B, k) int64, the drafted tokens.
        draft_probs: (B, k, V) fp32, q_i, the distributions the drafts were sampled from.
        target_probs: (B, k + 1, V) fp32, p_i, the verifier's distributions at the k draft positions and the next.
        generator: random source for the uniforms and the recovered/bonus draws.
        greedy: compare with the argmax instead of sampling (exact greedy path).

    Returns:
        ``(num_accepted, next_tokens)``: (B,) int64 in [0, k], the length of the accepted prefix; (B,) int64,
        the recovered token (num_accepted < k) or the bonus token (num_accepted == k).

    Raises:
        ValueError: inconsistent shapes.
    """
    b, k = draft_tokens.shape
    if (draft_probs.shape[:2] != (b, k) or target_probs.shape[:2] != (b, k + 1)
            or draft_probs.shape[-1] != target_probs.shape[-1]):
        raise ValueError(f"shapes: draft_tokens {tuple(draft_tokens.shape)}, draft_probs {tuple(draft_probs.shape)}, "
                         f"target_probs {tuple(target_probs.shape)}; expected (B,k), (B,k,V), (B,k+1,V)")
    rows = torch.arange(b, device=draft_tokens.device)
    if k == 0 and not greedy:  # nothing to verify: the next token ~ p_1 (the same draws as the general path below)
        return torch.zeros(b, dtype=torch.long, device=draft_tokens.device), sample(target_probs[:, 0], generator)
    if greedy:
        target_argmax = target_probs.argmax(-1)  # (B, k+1)
        accepted = draft_tokens == target_argmax[:, :k]  # (B, k)
        num_accepted = accepted.long().cumprod(-1).sum(-1)  # (B,)
        return num_accepted, target_argmax[rows, num_accepted]
    p_x = target_probs[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)  # (B, k)
    q_x = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)  # (B, k)
    u = torch.rand((b, k), generator=generator, device=draft_tokens.device)
    accepted = u * q_x < p_x  # accept with probability min(1, p/q)
    num_accepted = accepted.long().cumprod(-1).sum(-1)  # (B,)
    p_next = target_probs[rows, num_accepted]  # (B, V): p_j, or p_{k+1} for the bonus
    rejected = num_accepted < k
    q_next = draft_probs[rows, num_accepted.clamp(max=k - 1)]  # k >= 1 here
    residual = torch.clamp(p_next - q_next, min=0)  # (B, V), unnormalised: sample() draws w_i / sum(w)
    use_residual = rejected[:, None] & (residual.sum(-1, keepdim=True) > 0)
    dist = torch.where(use_residual, residual, p_next)
    next_tokens = sample(dist, generator)  # (B,): inverse-CDF draw (sampling.sample)
    return num_accepted, next_tokens
