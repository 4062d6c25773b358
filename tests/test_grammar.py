"""Structured output (``grammar.py``): every tier masks its logits with the grammar, so the output follows the
constrained target distribution exactly, and under greedy decoding every mode equals constrained plain decoding.

* Exact distribution: a tiny target over the 96-token character tokenizer, a 20-token prompt, the grammar
  ``[a-c][a-d]{2}`` (then only EOS): the 48 outputs' exact probabilities by enumeration with transformers' forward
  (the grammar's mask, then temperature and top-p), against N generations of each hierarchy: a chi-square
  goodness-of-fit test (cells with expected count < 5 pooled) must give p > 1e-3 (fixed seeds: under the null
  hypothesis a given seed fails with probability 1e-3), and no output may leave the grammar. The prompt repeats
  ``a``, ``b``, ``c``, ``d`` before other tokens, so the n-gram drafter proposes tokens outside the grammar. A
  hierarchy whose verifier ignores the grammar (its drafters masked) must fail.
* Greedy: each mode's tokens equal constrained autoregressive decoding's; outputs that end parse as JSON of the
  schema.
* Errors: malformed ``response_format`` values are named before any model work.
"""

import itertools
import json

import pytest
import torch
from scipy.stats import chisquare

pytest.importorskip("llguidance")

from tiny import char_tokenizer, hf_model, ours  # noqa: E402
from triforce.engine import Engine, SpeculationConfig  # noqa: E402
from triforce.speculation.grammar import GrammarError, constraint_for  # noqa: E402
from triforce.speculation.sampling import SamplingParams, logits_to_probs  # noqa: E402
from triforce.speculation.tiers import ModelTier  # noqa: E402

V, N = 96, 3000
TOK = char_tokenizer()
REGEX = {"type": "regex", "regex": "[a-c][a-d]{2}"}
FIRST, LATER = TOK.convert_tokens_to_ids(list("abc")), TOK.convert_tokens_to_ids(list("abcd"))
OUTPUTS = list(itertools.product(FIRST, LATER, LATER))  # the grammar's 48 outputs
PARAMS = SamplingParams(0.8, 0.9, 0)
SPECS = {
    "autoregressive": SpeculationConfig(mode="autoregressive"),
    "triforce": SpeculationConfig(mode="triforce", budget=8, chunk_size=2, gamma1=2, gamma2=2, draft_sink=2,
                                  draft_window=4),
    "ngram": SpeculationConfig(tiers="ngram:2", ngram_n=1),  # drafts 40..43 after a..d: outside the grammar
}


@pytest.fixture(scope="module")
def models():
    target_hf = hf_model(seed=31, vocab=V, layers=2, hidden=32, init=0.05)  # soft logits: every output is likely
    draft_hf = hf_model(seed=32, vocab=V, layers=1, hidden=16, heads=2, kv_heads=1, init=0.3)
    a, b, c, d = LATER
    rest = torch.randint(3, V, (12,), generator=torch.Generator().manual_seed(7)).tolist()
    prompt = [a, 40, b, 41, c, 42, d, 43] + rest  # after a, b, c or d the n-gram drafter proposes 40..43
    return target_hf, ours(target_hf), ours(draft_hf), prompt


def exact_distribution(hf, prompt):
    """P(output) of the 48 outputs under the constrained target: mask, then temperature and top-p."""
    prefixes = list(itertools.product(FIRST, LATER))
    ids = torch.tensor([prompt + list(p) for p in prefixes])
    with torch.no_grad():
        logits = hf(ids).logits[:, len(prompt) - 1:]  # (12, 3, V): the next-token logits at the 3 positions
    allowed = torch.zeros(3, V, dtype=torch.bool)
    allowed[0, FIRST], allowed[1:, LATER] = True, True
    probs = logits_to_probs(logits.masked_fill(~allowed, float("-inf")), PARAMS).double()
    table = {}
    for row, (x0, x1) in enumerate(prefixes):
        for x2 in LATER:
            table[(x0, x1, x2)] = float(probs[row, 0, x0] * probs[row, 1, x1] * probs[row, 2, x2])
    return torch.tensor([table[o] for o in OUTPUTS], dtype=torch.float64)


def empirical(engine, prompt, spec, n, seed):
    """Counts of the 48 outputs over n generations of 3 tokens, and how many outputs left the grammar."""
    index = {o: i for i, o in enumerate(OUTPUTS)}
    counts, outside = torch.zeros(len(OUTPUTS), dtype=torch.float64), 0
    constraint = constraint_for(REGEX, TOK, V, engine.eos_ids)
    for i in range(n):
        out, _ = engine.generate(prompt, max_new_tokens=3, sampling=PARAMS, spec=spec, seed=seed * 1_000_003 + i,
                                 constraint=constraint)
        if tuple(out) in index:
            counts[index[tuple(out)]] += 1
        else:
            outside += 1
    return counts, outside


def pvalue(counts, probs):
    expected = probs / probs.sum() * counts.sum()
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]]) if (~big).any() else counts
    exp = torch.cat([expected[big], expected[~big].sum()[None]]) if (~big).any() else expected
    assert (exp > 0).sum() >= 10
    return chisquare(obs.numpy(), exp.numpy()).pvalue


def test_the_grammar_masks_are_the_regex():
    constraint = constraint_for(REGEX, TOK, V, (2,))
    constraint.begin(0)
    assert constraint.allowed([]).nonzero().flatten().tolist() == FIRST
    assert constraint.allowed(FIRST[:1]).nonzero().flatten().tolist() == LATER
    assert constraint.allowed(FIRST[:1] + LATER[:2]).nonzero().flatten().tolist() == [2]  # only EOS
    assert constraint.allowed([LATER[3]]) is None  # "d" cannot start


@pytest.mark.parametrize("name", list(SPECS))
def test_each_hierarchy_samples_the_constrained_distribution(models, name):
    hf, target, draft, prompt = models
    counts, outside = empirical(Engine(target, draft), prompt, SPECS[name], N, seed=list(SPECS).index(name) + 3)
    assert outside == 0
    assert pvalue(counts, exact_distribution(hf, prompt)) > 1e-3


def test_a_verifier_that_ignores_the_grammar_fails_the_same_test(models, monkeypatch):
    hf, target, draft, prompt = models
    set_constraint = ModelTier.set_constraint

    def verifier_unmasked(self, constraint):
        set_constraint(self, constraint)
        if self.is_top:
            self.constraint = None

    monkeypatch.setattr(ModelTier, "set_constraint", verifier_unmasked)
    try:
        counts, outside = empirical(Engine(target, draft), prompt, SPECS["triforce"], 500, seed=9)
    except GrammarError:  # a masked lower tier saw the verifier's output leave the language and refused to go on
        return
    assert outside > 0 or pvalue(counts, exact_distribution(hf, prompt)) < 1e-3


SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 1, "maxItems": 4,
          "x-guidance": {"whitespace_flexible": False}}


def test_greedy_equals_constrained_plain_decoding_in_every_mode(models):
    _, target, draft, _ = models
    engine = Engine(target, draft)
    fmt = {"type": "json_schema", "json_schema": {"name": "numbers", "schema": SCHEMA}}
    for seed in range(4):
        prompt = torch.randint(3, V, (40,), generator=torch.Generator().manual_seed(seed)).tolist()
        outs = {}
        for name, spec in SPECS.items():
            out, _ = engine.generate(prompt, max_new_tokens=24, sampling=SamplingParams(temperature=0), spec=spec,
                                     constraint=constraint_for(fmt, TOK, V, engine.eos_ids))
            outs[name] = out
        assert all(out == outs["autoregressive"] for out in outs.values()), outs
        text = TOK.decode(outs["autoregressive"], skip_special_tokens=True)
        if outs["autoregressive"][-1] == 2:  # ended: the whole output is an array of the schema
            value = json.loads(text)
            assert isinstance(value, list) and 1 <= len(value) <= 4 and all(0 <= x <= 99 for x in value)
        else:
            assert text.startswith("[")


def test_long_reference_chains_compile_on_a_deep_stack():
    """A chain of 1,000 ``$ref`` overflowed the 8 MiB main-thread stack inside llguidance (a crash); 3,000 compile."""
    defs = {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(3000)}
    schema = {"$defs": {**defs, "d3000": {"type": "string"}}, "$ref": "#/$defs/d0"}
    constraint = constraint_for({"type": "json_schema", "json_schema": {"schema": schema}}, TOK, V, (2,))
    constraint.begin(0)
    assert constraint.allowed([]).nonzero().flatten().tolist() == TOK.convert_tokens_to_ids(["{"])


@pytest.mark.parametrize("fmt,reason", [
    ({"type": "regex", "regex": "[a&&b]"}, "no token can continue"),  # an empty language
    ({"type": "regex", "regex": "(a{1000}){1000}"}, "too many expressions"),  # past llguidance's lexer limit
])
def test_a_failing_matcher_is_an_error_not_a_finished_output(fmt, reason):
    constraint = constraint_for(fmt, TOK, V, (2,))
    constraint.begin(0)
    with pytest.raises(GrammarError, match=reason):
        for output in ([], TOK.convert_tokens_to_ids(["a"])):
            constraint.allowed(output)


@pytest.mark.parametrize("value,message", [
    ("json", "must be an object with a type"),
    ({"type": "yaml"}, "type must be one of"),
    ({"type": "json_schema"}, "json_schema must be an object"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": 5}}, "schema must be a JSON schema object"),
    ({"type": "regex", "regex": "[ab"}, "regex"),
    ({"type": "lark", "lark": ""}, "non-empty string"),
    ({"type": "json_schema", "json_schema": {"strict": True}}, "schema must be a JSON schema object, got none"),
    ({"type": "json_schema", "json_schema": {"schema": {"enum": {1, 2}}}}, "is not JSON"),
    ({"type": "lark", "lark": "start: foo"}, "unknown name"),
    ({"type": "regex", "regex": "a" * 300_000}, "at most 262144"),
])
def test_malformed_response_formats_are_named(value, message):
    with pytest.raises(ValueError, match="response_format") as e:
        constraint_for(value, TOK, V, (2,))
    assert message in str(e.value)
