"""Log-probabilities (logprobs.py): every mode reports, for each emitted token, transformers' log-softmax of the same
model at that position (within 1e-4, fp32), with the same most likely alternatives; the prompt's (echo) too.

The reference is transformers' model of the same folder run over the prompt and the tokens our engine emitted:
the log-probability of a token does not depend on how it was drafted, so a wrong row (an off-by-one in a block, a
lower tier's logits, a temperature applied) shows as a difference far above the bound.
"""

import pytest
import torch

from triforce import SamplingParams, SpeculationConfig, TriForce
from triforce.speculation.logprobs import MAX_TOP_LOGPROBS, TokenLogprob

PROMPT = [3 + (7 * i * i + i) % 90 for i in range(60)]
TOP = 5
MODES = {
    "autoregressive": SpeculationConfig(mode="autoregressive"),
    "retrieval": SpeculationConfig(mode="retrieval", budget=24, chunk_size=4, gamma2=5),
    "ngram": SpeculationConfig(mode="draft", drafter="ngram", gamma2=4),
    "triforce": SpeculationConfig(mode="triforce", drafter="ngram", budget=24, chunk_size=4, gamma1=2, gamma2=4),
    "auto": SpeculationConfig(mode="auto"),
}


@pytest.fixture(scope="module")
def tf(tiny_folder):
    return TriForce.load(tiny_folder, threads=1)


@pytest.fixture(scope="module")
def hf(tiny_folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_folder, dtype=torch.float32).eval()


def reference(hf, ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax at every position of ``ids``: (len, V) fp32, row i predicts ids[i + 1]."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, -1)


def check(entries: list[TokenLogprob], ref: torch.Tensor, tokens: list[int], top: int) -> None:
    assert [e.token_id for e in entries] == tokens
    for e, row in zip(entries, ref):
        assert e.logprob == pytest.approx(float(row[e.token_id]), abs=1e-4)
        assert len(e.top) == top
        if top:
            ids, vals = [t for t, _ in e.top], [v for _, v in e.top]
            assert vals == sorted(vals, reverse=True)
            want = row.topk(top).values.tolist()
            assert vals == pytest.approx(want, abs=1e-4)
            assert all(float(row[i]) == pytest.approx(v, abs=1e-4) for i, v in zip(ids, vals))
            assert e.logprob <= vals[0] + 1e-6  # nothing is more likely than the most likely


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "T0.8"])
@pytest.mark.parametrize("mode", list(MODES))
def test_every_mode_reports_the_models_logprobs(tf, hf, mode, temperature):
    sampling = SamplingParams(temperature=temperature, top_p=0.9, logprobs=TOP)
    res = tf.generate(PROMPT, max_new_tokens=24, sampling=sampling, spec=MODES[mode], seed=3)
    assert res.logprobs is not None and len(res.logprobs) == len(res.token_ids) == 24
    ref = reference(hf, PROMPT + res.token_ids)[len(PROMPT) - 1:-1]  # rows that predicted the emitted tokens
    check(res.logprobs, ref, res.token_ids, TOP)
    if temperature == 0:  # greedy: every emitted token is the most likely one, in every mode
        assert all(e.top[0][0] == e.token_id for e in res.logprobs)
    if mode in ("retrieval", "triforce"):  # the speculation really ran (the n-gram tier may find nothing to propose)
        assert res.stats.tiers["target"]["proposed"] > 0


def test_stream_events_carry_the_logprobs_and_json_lists_them(tf, hf):
    sampling = SamplingParams(temperature=0, logprobs=0)
    gen = tf.stream(PROMPT, max_new_tokens=10, sampling=sampling, spec=MODES["retrieval"])
    events = []
    try:
        while True:
            events.append(next(gen))
    except StopIteration as stop:
        result = stop.value
    per_token = [e.logprob for e in events if e.token_id is not None]
    assert per_token == result.logprobs and all(e.top == () for e in per_token)
    check(per_token, reference(hf, PROMPT + result.token_ids)[len(PROMPT) - 1:-1], result.token_ids, 0)
    d = result.to_dict()
    assert [x["token_id"] for x in d["logprobs"]] == result.token_ids and d["logprobs"][0]["top_logprobs"] == []
    assert "logprobs" not in tf.generate(PROMPT, max_new_tokens=2, sampling=SamplingParams(temperature=0)).to_dict()


def test_prompt_logprobs_equal_transformers(tf, hf):
    out = tf.prompt_logprobs(PROMPT, top_logprobs=3)
    assert len(out) == len(PROMPT) and out[0] is None
    check(out[1:], reference(hf, PROMPT)[:-1], PROMPT[1:], 3)
    tf_small = tf.fork()  # chunks of a few tokens give the same values as one pass
    from triforce.speculation.logprobs import prompt_logprobs

    chunked = prompt_logprobs(tf_small.target.model, PROMPT, 3, chunk=7)
    assert [e.token_id for e in chunked[1:]] == PROMPT[1:]
    assert all(a.logprob == pytest.approx(b.logprob, abs=1e-5) for a, b in zip(chunked[1:], out[1:]))


@pytest.mark.parametrize("value", [-1, MAX_TOP_LOGPROBS + 1, True, 2.0, "5"])
def test_bad_logprobs_are_refused_naming_the_parameter(tf, value):
    with pytest.raises(ValueError, match="logprobs must be an integer in \\[0, 20\\]"):
        SamplingParams(logprobs=value)
    with pytest.raises(ValueError, match="top_logprobs must be"):
        tf.prompt_logprobs(PROMPT, top_logprobs=value)
    with pytest.raises(ValueError, match="at least one token"):
        tf.prompt_logprobs([])
