"""The exact-distribution check shared by the sampling tests: tiny models over a 5-token vocabulary, the exact
distribution of 3 generated tokens by enumeration, empirical counts, and a chi-square goodness-of-fit p-value.

A tiny target with a 5-token vocabulary and a 20-token prompt: the exact distribution of the 3 generated tokens
(125 sequences) is computed by enumeration with the transformers implementation of the target; a test generates N
sequences and a chi-square test (cells with expected count < 5 pooled) must give p > 1e-3 (fixed seeds; under the
null hypothesis a given seed fails with probability 1e-3). The ``distribution_models`` fixture (``conftest.py``)
returns :func:`distribution_models`.
"""

import itertools

import torch
from scipy.stats import chisquare

from tiny import hf_model, ours
from triforce.speculation.sampling import SamplingParams, logits_to_probs, sample

V, NEW, PROMPT_LEN = 5, 3, 20
N_FAST, N_SLOW = 3000, 20000
# CI time: a feature on top of a mode (depth 4, adaptive gamma, int8 / bf16 lower tiers, the self tier, the attn chunk
# score, auto's bypasses) is sampled fewer times than the modes and the broken middle tier (whose failure at N_FAST
# shows the test's power)
N_FEATURE = 2500
SETTINGS = {"T1": SamplingParams(1.0, 1.0, 0), "T0.6-p0.9-k5": SamplingParams(0.6, 0.9, 5)}


def distribution_models():
    """``(target_hf, target, draft, prompt)``: a 2-layer transformers target over ``V`` tokens, ours with its
    weights, a sharp 1-layer draft (frequent tier-1 rejections), and a ``PROMPT_LEN``-token prompt."""
    target_hf = hf_model(seed=21, vocab=V, layers=2, hidden=32, init=0.15)
    draft_hf = hf_model(seed=22, vocab=V, layers=1, hidden=16, heads=2, kv_heads=1, init=0.5)
    prompt = torch.randint(0, V, (PROMPT_LEN,), generator=torch.Generator().manual_seed(5)).tolist()
    return target_hf, ours(target_hf), ours(draft_hf), prompt


def exact_distribution(hf, prompt, params):
    """P(x1, x2, x3 | prompt) for all V^3 sequences, by enumeration with transformers' forward."""
    conts = torch.tensor(list(itertools.product(range(V), repeat=NEW - 1)))  # (V^2, 2)
    ids = torch.cat([torch.tensor(prompt).expand(len(conts), -1), conts], 1)
    with torch.no_grad():
        logits = hf(ids).logits[:, PROMPT_LEN - 1:]  # (V^2, 3, V): next-token logits at the 3 positions
    probs = logits_to_probs(logits, params)
    table = torch.zeros((V,) * NEW, dtype=torch.float64)
    for row, (a, b) in enumerate(conts.tolist()):
        p1, p2, p3 = probs[row, 0].double(), probs[row, 1].double(), probs[row, 2].double()
        table[a, b] = p1[a] * p2[b] * p3
    return table.flatten()


def empirical(engine, prompt, params, spec, n, seed):
    """Counts (V^3,) float64 of ``n`` generated 3-token sequences, seeds ``seed * 1_000_003 + i``."""
    counts = torch.zeros(V**NEW, dtype=torch.float64)
    for i in range(n):
        out, _ = engine.generate(prompt, max_new_tokens=NEW, sampling=params, spec=spec, seed=seed * 1_000_003 + i)
        counts[out[0] * V * V + out[1] * V + out[2]] += 1
    return counts


def chi2_pvalue(counts, probs):
    """Chi-square goodness-of-fit p-value of ``counts`` against ``probs`` (cells of expected count < 5 pooled);
    asserts that no sequence of probability 0 was generated."""
    n = counts.sum()
    expected = probs / probs.sum() * n
    assert counts[expected == 0].sum() == 0, "generated a sequence of probability 0"
    big = expected >= 5
    small = ~big & (expected > 0)
    obs = torch.cat([counts[big], counts[small].sum()[None]])
    exp = torch.cat([expected[big], expected[small].sum()[None]])
    keep = exp > 0
    assert keep.sum() >= 10
    return chisquare(obs[keep].numpy(), exp[keep].numpy()).pvalue


def middle_tier_resamples_from_p(draft_tokens, draft_probs, target_probs, generator=None, greedy=False):
    """The reference code's Middle_Spec bug: after a rejection, draw from p instead of norm(max(p - q, 0))."""
    b, k = draft_tokens.shape
    rows = torch.arange(b)
    p_x = target_probs[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)
    q_x = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)
    accepted = torch.rand((b, k), generator=generator) * q_x < p_x
    n_acc = accepted.long().cumprod(-1).sum(-1)
    return n_acc, sample(target_probs[rows, n_acc], generator)
