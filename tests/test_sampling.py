"""Logits processing equals transformers' warpers; the verification rule emits the target distribution."""

import itertools

import pytest
import torch
from scipy.stats import chisquare

from triforce.speculation.rule import rejection_sample
from triforce.speculation.sampling import SamplingParams, logits_to_probs


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, 0), (0.6, 0.9, 0), (0.3, 0.5, 5), (1.3, 0.95, 20)])
def test_logits_to_probs_matches_transformers_warpers(temperature, top_p, top_k):
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(0)) * 3
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)] + ([TopKLogitsWarper(top_k)] if top_k else [])
                                  + ([TopPLogitsWarper(top_p)] if top_p < 1 else []))
    ref = torch.softmax(warpers(None, logits.clone()), -1)
    ours = logits_to_probs(logits, SamplingParams(temperature, top_p, top_k))
    assert torch.allclose(ours, ref, atol=1e-6)
    assert ours.dtype == torch.float32


@pytest.mark.parametrize("scale", [8.0, 0.05])  # peaked rows (nucleus among the top-k candidates), flat (sort path)
def test_top_p_on_a_large_vocabulary_matches_transformers(scale):
    """Rows of a 49,152-token vocabulary: the candidates path and the sort fallback give transformers' nucleus."""
    from transformers.generation.logits_process import TopPLogitsWarper

    from triforce.speculation.sampling import NUCLEUS_CANDIDATES

    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 49152, generator=gen) * scale
    logits[0] = torch.randn(49152, generator=gen) * 0.05  # one flat row among peaked ones: both paths in one call
    ref = torch.softmax(TopPLogitsWarper(0.9)(None, (logits / 0.6).clone()), -1)
    ours = logits_to_probs(logits, SamplingParams(0.6, 0.9, 0))
    assert torch.equal(ours > 0, ref > 0)
    assert torch.allclose(ours, ref, atol=1e-6)
    kept = (ours > 0).sum(-1)
    assert (kept[1:] < NUCLEUS_CANDIDATES).all() if scale > 1 else (kept > NUCLEUS_CANDIDATES).all()


def test_greedy_is_one_hot_on_first_argmax():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0]], dtype=torch.bfloat16)
    probs = logits_to_probs(logits, SamplingParams(temperature=0))
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0]]


@pytest.mark.parametrize("kwargs,name", [({"temperature": -0.1}, "temperature"), ({"top_p": 0.0}, "top_p"),
                                          ({"top_p": 1.5}, "top_p"), ({"top_k": -1}, "top_k"),
                                          ({"top_k": 2.5}, "top_k"), ({"temperature": float("nan")}, "temperature")])
def test_bad_sampling_params_name_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def _dists(v, n, gen, params):
    """n random (p, q) pairs of processed distributions over v tokens, p and q deliberately different."""
    p = logits_to_probs(torch.randn(n, v, generator=gen) * 0.6, params)
    q = logits_to_probs(torch.randn(n, v, generator=gen) * 0.6, params)
    return p, q


TRIALS = 20_000
GRID = list(itertools.product([0.3, 0.6, 1.0], [0.9, 1.0], [0, 5]))


@pytest.mark.parametrize("temperature,top_p,top_k", GRID)
def test_rejection_sampling_emits_target_distribution(temperature, top_p, top_k):
    """One draft position, 20,000 vectorised trials: the emitted token ~ p exactly.

    Bound: chi-square goodness of fit (cells with expected count < 5 pooled), p-value > 1e-3 with fixed seeds;
    under the null hypothesis a given seed fails with probability 1e-3.
    """
    params = SamplingParams(temperature, top_p, top_k)
    gen = torch.Generator().manual_seed(hash((temperature, top_p, top_k)) % 2**31)
    v = 12
    p1, q1 = _dists(v, 1, gen, params)
    p = p1.expand(TRIALS, v)[:, None]  # (N, 1, V): one draft position
    q = q1.expand(TRIALS, v)[:, None]
    drafts = torch.multinomial(q[:, 0], 1, replacement=True, generator=gen)  # (N, 1) ~ q
    bonus_p = torch.full((TRIALS, 1, v), 1.0 / v)
    n_acc, nxt = rejection_sample(drafts, q, torch.cat([p, bonus_p], 1), gen)
    emitted = torch.where(n_acc == 1, drafts[:, 0], nxt)  # the token at the draft position
    _assert_matches(emitted, p1[0])
    # the rule is not trivially accepting: some rejections happened
    assert 0 < (n_acc == 0).float().mean() < 1


def _assert_matches(samples, probs, alpha=1e-3):
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double() / probs.double().sum() * samples.numel()
    assert counts[expected == 0].sum() == 0, "sampled a token of probability 0"
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big & (expected > 0)].sum()[None]])
    exp = torch.cat([expected[big], expected[~big & (expected > 0)].sum()[None]])
    keep = exp > 0
    assert keep.sum() >= 3, "too few cells for a meaningful test"
    stat = chisquare(obs[keep].numpy(), exp[keep].numpy())
    assert stat.pvalue > alpha, f"chi-square p={stat.pvalue:.2e}"


def test_rejection_sampling_second_position_and_bonus():
    """Three drafts: the token emitted at position 2 (given positions 0-1 accepted) ~ p_2, the bonus ~ p_4."""
    gen = torch.Generator().manual_seed(7)
    v, k = 6, 3
    params = SamplingParams(1.0, 1.0, 0)
    p, q = _dists(v, k + 1, gen, params)
    q = q[:k]
    n = TRIALS
    drafts = torch.stack([torch.multinomial(q[i].expand(n, v), 1, generator=gen)[:, 0] for i in range(k)], 1)
    n_acc, nxt = rejection_sample(drafts, q.expand(n, k, v), p.expand(n, k + 1, v), gen)
    reached = n_acc >= 2  # position 2 was verified
    at2 = torch.where(n_acc[reached] >= 3, drafts[reached, 2], nxt[reached])
    _assert_matches(at2, p[2])
    bonus = nxt[n_acc == k]
    assert bonus.numel() > 200
    _assert_matches(bonus, p[k])


def test_broken_rule_fails_the_same_test():
    """Resampling from p (not the residual) after a rejection is biased; the chi-square test catches it."""
    gen = torch.Generator().manual_seed(11)
    v = 12
    p1, q1 = _dists(v, 1, gen, SamplingParams(1.0, 1.0, 0))
    drafts = torch.multinomial(q1.expand(TRIALS, v), 1, replacement=True, generator=gen)
    u = torch.rand(TRIALS, generator=gen)
    accept = u * q1[0, drafts[:, 0]] < p1[0, drafts[:, 0]]
    from_p = torch.multinomial(p1.expand(TRIALS, v), 1, generator=gen)[:, 0]
    emitted = torch.where(accept, drafts[:, 0], from_p)
    with pytest.raises(AssertionError, match="chi-square"):
        _assert_matches(emitted, p1[0])


def test_greedy_rule_accepts_prefix_of_argmax():
    p = torch.zeros(1, 4, 5)
    for i, t in enumerate([3, 1, 4, 2]):
        p[0, i, t] = 1.0
    drafts = torch.tensor([[3, 1, 0]])
    n_acc, nxt = rejection_sample(drafts, torch.zeros(1, 3, 5), p, greedy=True)
    assert n_acc.tolist() == [2] and nxt.tolist() == [4]
    n_acc, nxt = rejection_sample(torch.tensor([[3, 1, 4]]), torch.zeros(1, 3, 5), p, greedy=True)
    assert n_acc.tolist() == [3] and nxt.tolist() == [2]  # bonus = argmax of p_4


def test_zero_residual_falls_back_to_p():
    """p == q: rejection has probability 0, but if rounding rejects, the residual is all zero: draw from p."""
    p = torch.tensor([[[0.5, 0.5, 0.0]]])
    q = p.clone()
    drafts = torch.tensor([[0]])
    target = torch.cat([p * (1 - 1e-7), torch.tensor([[[0.0, 0.0, 1.0]]])], 1)  # p(x)/q(x) just below 1
    gen = torch.Generator().manual_seed(0)
    n_acc, nxt = rejection_sample(drafts.expand(5000, 1), q.expand(5000, 1, 3), target.expand(5000, 2, 3), gen)
    rejected = nxt[n_acc == 0]
    assert set(rejected.tolist()) <= {0, 1}  # from p, never the bonus distribution's token 2, never NaN


def test_shape_errors_are_named():
    with pytest.raises(ValueError, match="shapes"):
        rejection_sample(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, 5), torch.zeros(1, 2, 5))


def test_inverse_cdf_sample_draws_each_row_from_its_distribution():
    """``sampling.sample``: each row's draws fit its (unnormalised) weights, chi-square p > 1e-3 over 20,000 draws
    per row, never a zero-weight token, and the last token is reachable; rows of zeros, NaN, inf or a negative entry
    and shapes other than (N, V) are refused."""
    from triforce.speculation.sampling import sample

    gen = torch.Generator().manual_seed(7)
    v, n = 50, 20000
    w = torch.rand(3, v, generator=gen) * (torch.rand(3, v, generator=gen) < 0.5)  # about half the tokens at 0
    w[2] = 0
    w[2, -1], w[2, 3], w[2, 10] = 2.0, 1.0, 0.5  # mass on the last token and two others, unnormalised
    draws = torch.stack([sample(w, gen) for _ in range(n)])  # (n, 3)
    for row in range(3):
        probs = w[row] / w[row].sum()
        assert bool((probs[draws[:, row]] > 0).all())
        _assert_matches(draws[:, row], probs)
    assert draws[:, 2].eq(v - 1).any()
    for bad in (torch.zeros(1, v), torch.full((1, v), float("nan")), torch.full((1, v), float("inf")),
                torch.tensor([[-0.1, 1.0, 0.0]])):
        with pytest.raises(ValueError, match="positive, finite sum"):
            sample(bad, gen)
    for shape in ((v,), (2, 3, v), (2, 0)):
        with pytest.raises(ValueError, match="probs must be"):
            sample(torch.ones(shape), gen)


def _kernel_on():
    from triforce.kernels.sampling import sampling_status

    status = sampling_status()
    if not status.startswith("on"):
        pytest.skip(f"sampling kernel {status}")


def _rows_for_the_kernel():
    """(N, V) logits of every kind a step meets: peaked rows at several scales, exact ties at the top and at the
    nucleus boundary, top-k's -inf, a flat row among peaked ones (the kernel leaves it to the sort), one-token rows."""
    gen = torch.Generator().manual_seed(3)
    v = 49152
    rows = [torch.randn(v, generator=gen) * s for s in (2.0, 4.0, 8.0, 16.0)]
    tied = torch.randn(v, generator=gen)
    tied[[5, 77, 4000]] = 9.0  # three tokens of equal, highest probability
    rows.append(tied)
    boundary = torch.full((v,), -30.0)
    boundary[:20] = 0.0  # 20 equal tokens: the nucleus boundary falls among ties
    rows.append(boundary)
    masked = torch.randn(v, generator=gen) * 4
    masked[torch.randperm(v, generator=gen)[: v // 2]] = float("-inf")
    rows.append(masked)
    rows.append(torch.randn(v, generator=gen) * 0.05)  # flat: a nucleus of ~44K tokens
    one = torch.full((v,), -100.0)
    one[v - 1] = 0.0
    rows.append(one)
    return torch.stack(rows)


@pytest.mark.parametrize("temperature,top_p", [(0.6, 0.9), (1.0, 0.5), (0.3, 0.99)])
def test_sampling_kernel_matches_pytorch_ops(monkeypatch, temperature, top_p):
    """``csrc/sampling.c``'s nucleus against the same rule in PyTorch's ops (the fallback): the same support in every
    row, probabilities within 1e-7, row by row and for the whole block in one call (the flat row makes the kernel
    hand that call back to the sort). Where the boundary falls among equal probabilities (row 5: 20 tokens of 0.05)
    either rule keeps as many of them; the kernel the lowest indices, PyTorch's topk an order of its own."""
    _kernel_on()
    from triforce.speculation import sampling

    logits = _rows_for_the_kernel()
    params = SamplingParams(temperature, top_p, 0)
    ours = logits_to_probs(logits, params)
    single = torch.cat([logits_to_probs(row[None], params) for row in logits])
    monkeypatch.setattr(sampling, "_kernel_rows", lambda x: None)
    ref = logits_to_probs(logits, params)
    tied = 5
    kept = {0.9: 18, 0.5: 10, 0.99: 20}[top_p]  # tokens of 0.05 kept: those with less than top_p ranked above
    for got in (ours, single):
        others = [r for r in range(len(logits)) if r != tied]
        assert torch.equal(got[others] > 0, ref[others] > 0)
        assert torch.allclose(got[others], ref[others], rtol=1e-6, atol=1e-7)
        assert (got[tied] > 0).sum().item() == (ref[tied] > 0).sum().item() == kept
        assert torch.allclose(got[tied].sort().values, ref[tied].sort().values, atol=1e-7)
    assert (single[tied] > 0).nonzero().flatten().tolist() == list(range(kept))


def test_sampling_kernel_draws_what_pytorch_ops_draw(monkeypatch):
    """``triforce_sample`` against PyTorch's inverse CDF: the same token for the same uniforms, in nucleus rows
    (runs of zeros skipped) and dense ones, 2,000 draws; a row that is not a distribution is refused the same way."""
    _kernel_on()
    from triforce.speculation import sampling

    probs = logits_to_probs(_rows_for_the_kernel(), SamplingParams(0.6, 0.9, 0))
    dense = torch.softmax(torch.randn(2, 49152, generator=torch.Generator().manual_seed(4)), -1)
    w = torch.cat([probs, dense])
    ours = torch.stack([sampling.sample(w, g) for g in [torch.Generator().manual_seed(s) for s in range(2000)]])
    monkeypatch.setattr(sampling, "_kernel_rows", lambda x: None)
    ref = torch.stack([sampling.sample(w, g) for g in [torch.Generator().manual_seed(s) for s in range(2000)]])
    assert torch.equal(ours, ref)
    assert bool((w.gather(1, ours.T) > 0).all())


def test_sampling_kernel_rounds_the_boundary_as_pytorch_ops(monkeypatch):
    """At top-p near 1 and in rows of equal probabilities the nucleus boundary falls within the rounding of the mass
    ranked above a token: the kernel keeps exactly the tokens PyTorch's path keeps (the mass accumulated in fp64 and
    rounded to fp32 at each step, as CPU cumsum does; a float sum kept 1 token too many in a uniform row and dropped
    one at top-p 0.999999), and the same row gives the same result alone and beside a flat row that the kernel leaves
    to the full sort."""
    _kernel_on()
    from triforce.speculation import sampling

    gen = torch.Generator().manual_seed(9)
    cases = [(torch.randn(2000, 100, generator=gen) * 2, SamplingParams(1.0, tp, 0)) for tp in (0.999, 0.99999)]
    cases += [(torch.zeros(1, v), SamplingParams(1.0, tp, 0)) for v in (10, 31, 100) for tp in (0.1, 0.5, 0.9)]
    row = torch.full((200,), float("-inf"))
    row[:4] = torch.tensor([1.6826171875, -3.880859375, -6.39453125, 7.359375])  # top-p 0.999999 keeps token 2
    cases.append((row[None], SamplingParams(1.0, 0.999999, 0)))
    ours = [logits_to_probs(x, sp) for x, sp in cases]
    in_block = logits_to_probs(torch.stack([row, torch.zeros(200)]), SamplingParams(1.0, 0.999999, 0))[0]
    monkeypatch.setattr(sampling, "_kernel_rows", lambda x: None)
    for i, (got, (x, sp)) in enumerate(zip(ours, cases)):
        ref = logits_to_probs(x, sp)
        if 2 <= i < len(cases) - 1:  # uniform rows: as many of the equal tokens, whichever
            got, ref = got.sort(-1).values, ref.sort(-1).values
        assert torch.equal(got > 0, ref > 0), (x.shape, sp)
        assert torch.allclose(got, ref, rtol=1e-6, atol=1e-7)
    assert torch.equal(in_block, ours[-1][0]) and ours[-1][0, 2] > 0
    assert [int((o > 0).sum()) for o in ours[2:-1]] == [1, 5, 9, 4, 16, 28, 10, 50, 90]


def test_sampling_kernel_refuses_a_row_before_drawing(monkeypatch):
    """A refused row leaves the generator as PyTorch's path leaves it: the rows are checked before the uniforms are
    drawn."""
    _kernel_on()
    from triforce.speculation import sampling

    def state_after_refusal():
        g = torch.Generator().manual_seed(0)
        with pytest.raises(ValueError, match="positive, finite sum"):
            sampling.sample(torch.tensor([[0.5, 0.5], [0.0, 0.0]]), g)
        return torch.rand(2, generator=g, dtype=torch.float64)

    ours = state_after_refusal()
    monkeypatch.setattr(sampling, "_kernel_rows", lambda x: None)
    assert torch.equal(ours, state_after_refusal())
