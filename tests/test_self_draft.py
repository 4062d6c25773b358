"""The ``self`` tier: the target drafting for itself with int4 (or int8/bf16) weights over a StreamingLLM cache.

Checked like every other tier: greedy equality with autoregressive decoding, the exact distribution by
enumeration (chi-square, p > 1e-3 with a fixed seed; under the null hypothesis a seed fails with probability
1e-3), and the int4 product against its dequantized reference.
"""

import pytest
import torch

from distribution import N_FEATURE, SETTINGS, chi2_pvalue, empirical, exact_distribution
from tiny import hf_model, ours
from triforce.engine import Engine, SpeculationConfig
from triforce.model.quant import INT4_GROUP, Int4Linear, lower_precision_copy
from triforce.model.transformer import Linear
from triforce.speculation.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0)


def _int4_reference(linear: Linear, x: torch.Tensor) -> torch.Tensor:
    """x @ W~^T with W~ dequantized from the group-wise scheme (independent of the kernel)."""
    w = linear.weight_t.detach().float().T  # (out, in)
    out, inp = w.shape
    wg = w.reshape(out, inp // INT4_GROUP, INT4_GROUP)
    lo, hi = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    q = torch.round((wg - lo) / scale).clamp(0, 15)
    scale_b, zero_b = scale.bfloat16().float(), (lo + 8 * scale).bfloat16().float()  # the kernel's bf16 scales
    deq = ((q - 8) * scale_b + zero_b).reshape(out, inp)
    return x @ deq.T


@pytest.mark.parametrize("rows", [1, 7])
def test_int4_linear_matches_dequantized_reference(rows):
    torch.manual_seed(0)
    lin = Linear(128, 96)
    with torch.no_grad():
        lin.weight_t.normal_()
    q = Int4Linear(lin)
    x = torch.randn(rows, 128)
    ref = _int4_reference(lin, x)
    got = q(x)
    # bf16 activations in the kernel: relative error of a 128-term dot product ~ 2^-8 * sqrt(128)
    assert (got - ref).abs().max() <= 0.03 * ref.abs().max()
    # and it really is a 4-bit approximation: far from the fp32 product, unlike rounding noise
    exact = x @ lin.weight_t.detach()
    assert (got - exact).abs().max() > (got - ref).abs().max()
    if q.packed is not None:  # the fallback path computes the same product
        q.packed, q.dequantized = None, torch.nn.Parameter(
            ((torch.zeros(0)).new_empty(0)), requires_grad=False)
        deq = _int4_reference(lin, torch.eye(128)).T  # (out, in): the dequantized weights themselves
        q.dequantized = torch.nn.Parameter(deq, requires_grad=False)
        assert torch.allclose(q(x), ref, atol=1e-4, rtol=1e-4)


def test_int4_copy_keeps_int8_where_groups_do_not_fit():
    model = ours(hf_model(seed=3, hidden=48, heads=4, kv_heads=2))  # 48 inputs: not a multiple of 32
    copy = lower_precision_copy(model, "int4")
    assert type(copy.layers[0].mlp.down_proj).__name__ == "Int4Linear"  # 96 inputs
    assert type(copy.layers[0].self_attn.qkv_proj).__name__ == "Int8Linear"


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_self_tier_equals_autoregressive_greedy(weights):
    target = ours(hf_model(seed=4, layers=3))  # hidden 64: int4 groups fit every projection
    engine = Engine(target)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 96, (int(n),), generator=g).tolist() for n in torch.randint(2, 80, (12,), generator=g)]
    specs = [SpeculationConfig(mode="draft", drafter="self", gamma2=4, draft_sink=2, draft_window=8,
                               self_weights=weights),
             SpeculationConfig(mode="triforce", drafter="self", gamma1=2, gamma2=5, budget=24, chunk_size=4,
                               draft_sink=2, draft_window=8, self_weights=weights, lower_weights="int8"),
             SpeculationConfig(tiers="ngram:3,self:2,retrieval:4", budget=20, chunk_size=4, draft_sink=2,
                               draft_window=8, self_weights=weights)]
    accepted = rejected = 0
    for prompt in prompts:
        ref, _ = engine.generate(prompt, max_new_tokens=24, sampling=GREEDY, spec=SpeculationConfig())
        for spec in specs:
            out, stats = engine.generate(prompt, max_new_tokens=24, sampling=GREEDY, spec=spec)
            assert out == ref, (prompt, spec.name)
            s = stats.tiers["target"]
            accepted += s["accepted"]
            rejected += s["proposed"] - s["accepted"]
            assert "self" in stats.tiers
    assert accepted > 0 and rejected > 0  # the self tier both drafted right and was corrected


@pytest.mark.parametrize("setting", [pytest.param("T1", marks=pytest.mark.slow), "T0.6-p0.9-k5"])
def test_self_hierarchy_matches_exact_distribution(distribution_models, setting):
    """self (int4) -> retrieval (int8) -> full target: the sequences follow the target's exact distribution."""
    hf, target, _, prompt = distribution_models
    params = SETTINGS[setting]
    spec = SpeculationConfig(mode="triforce", drafter="self", budget=8, chunk_size=2, gamma1=2, gamma2=2,
                             draft_sink=2, draft_window=4, lower_weights="int8")
    counts = empirical(Engine(target), prompt, params, spec, N_FEATURE, seed=91 + len(setting))
    assert chi2_pvalue(counts, exact_distribution(hf, prompt, params)) > 1e-3


def test_self_needs_no_draft_model_and_reports_its_tier():
    target = ours(hf_model(seed=5))
    spec = SpeculationConfig(mode="triforce", drafter="self", budget=16, chunk_size=4, draft_sink=2, draft_window=8)
    assert not spec.uses_draft
    _, stats = Engine(target).generate(list(range(3, 40)), max_new_tokens=8, sampling=GREEDY, spec=spec)
    assert list(stats.tiers) == ["self", "retrieval", "target"]
    with pytest.raises(ValueError, match="self_weights must be one of"):
        SpeculationConfig(drafter="self", self_weights="int2")


@pytest.mark.parametrize("mode", ["draft", "triforce"])
def test_drafter_prefill_skips_the_middle_of_a_long_prompt_and_stays_exact(mode):
    """A 420-token prompt: the streaming tiers prefill only the sinks and the last windows; greedy output unchanged."""
    from tiny import pair

    target, draft = pair(seed=6, max_pos=1024)
    engine = Engine(target, draft)
    prompt = torch.randint(3, 96, (420,), generator=torch.Generator().manual_seed(1)).tolist()
    ref, _ = engine.generate(prompt, max_new_tokens=16, sampling=GREEDY, spec=SpeculationConfig())
    for drafter in ("model", "self"):
        spec = SpeculationConfig(mode=mode, drafter=drafter, gamma1=2, gamma2=4, budget=64, chunk_size=4,
                                 draft_sink=4, draft_window=16)
        out, stats = engine.generate(prompt, max_new_tokens=16, sampling=GREEDY, spec=spec)
        assert out == ref
        bottom = stats.tiers["draft" if drafter == "model" else "self"]
        assert bottom["prefill_tokens"] == 4 + 2 * 16  # sinks + two windows, not the 419 prompt tokens
