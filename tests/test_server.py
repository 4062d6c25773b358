"""``triforce serve``: the OpenAI-compatible server, exercised with the official ``openai`` client and raw httpx.

Two servers on tiny models:

* ``server``: a real subprocess, ``python -m triforce.serve --model TINY --port 0 --threads 1`` (the port it
  bound is read from its log): chat and completions, streamed or not, greedy output equal to a direct cold
  ``TriForce.generate``, 8 concurrent clients, a client that disconnects mid-stream, 80 malformed requests,
  prefix reuse across chat turns, metrics.
* ``slow_server``: the same app in this process (uvicorn on a thread) over a model whose token stream is slowed
  to 10 ms per token, with ``queue_size=1`` and ``request_timeout=2``: cancellation on disconnect, 503 with
  Retry-After on a full queue, the per-request timeout, FastAPI's 422 turned into the 400 error shape.
"""

import json
import os
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from servers import chat_ids, metric, serve_in_thread, server_process, wait_idle, wait_until  # noqa: E402
from triforce import SamplingParams, SpeculationConfig, TriForce  # noqa: E402
from triforce.cli.serve import main_for_tests  # noqa: E402
from triforce.serve import ServerDefaults, create_app  # noqa: E402

GREEDY = SamplingParams(temperature=0)


# ------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def server(tiny_folder, tmp_path_factory):
    """Base URL of a server subprocess on the tiny model (default sampling: the CLI's, temperature 0.6)."""
    with server_process(tiny_folder, str(tmp_path_factory.mktemp("server") / "server.log")) as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def ref(tiny_folder):
    """The same model in this process, without prefix reuse: every reference generation is cold."""
    tf = TriForce.load(tiny_folder)
    tf.engine.reuse_prefix = False
    return tf


def ref_chat(tf, messages, max_tokens, stop=()):
    return tf.generate(chat_ids(tf, messages), max_new_tokens=max_tokens, sampling=GREEDY, stop=stop)


def openai_finish(reason: str) -> str:
    return "length" if reason == "length" else "stop"


class SlowTF:
    """A TriForce whose token stream sleeps ``delay`` seconds per token (everything else delegated)."""

    def __init__(self, tf, delay):
        self._tf, self._delay = tf, delay

    def __getattr__(self, name):
        return getattr(self._tf, name)

    def fork(self):
        return SlowTF(self._tf.fork(), self._delay)

    def stream(self, *args, **kwargs):
        gen = self._tf.stream(*args, **kwargs)
        try:
            while True:
                try:
                    event = next(gen)
                except StopIteration as stop:
                    return stop.value
                time.sleep(self._delay)
                yield event
        finally:
            gen.close()


@pytest.fixture(scope="module")
def slow_server(tiny_folder):
    """(base URL, app) of an in-process server over a slowed model: one request at a time (max_batch=1),
    queue_size=1, request_timeout=2 s."""
    tf = SlowTF(TriForce.load(tiny_folder), 0.01)
    app = create_app(tf, ServerDefaults(model_id="slow", temperature=0, queue_size=1, max_batch=1,
                                        request_timeout=2.0))
    with serve_in_thread(app) as url:
        yield url, app


def long_prompt(ref, n=300):
    """A prompt whose greedy continuation runs at least ``n`` tokens before an EOS."""
    for prompt in ("hello world", "the quick brown fox", "abc", "zzz", "once upon a time", "x"):
        if len(ref.generate(prompt, max_new_tokens=n, sampling=GREEDY).token_ids) >= n:
            return prompt
    pytest.fail("no candidate prompt runs long enough on the tiny model")


def assert_error_shape(r, status, param="<any>"):
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    if param != "<any>":
        assert err["param"] == param, (param, err)
    return err


# ------------------------------------------------------------------------------------------------ basics
def test_health_and_models(server, client, tiny_folder):
    model_id = os.path.basename(os.path.normpath(tiny_folder))
    h = httpx.get(server + "/health").json()
    assert h["status"] == "ok" and h["model"] == model_id
    assert [m.id for m in client.models.list()] == [model_id]
    assert client.models.retrieve(model_id).id == model_id
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_chat_greedy_equals_direct_generate(client, ref, tiny_folder):
    model_id = os.path.basename(os.path.normpath(tiny_folder))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}]
    expect = ref_chat(ref, messages, 40)
    r = client.chat.completions.create(model=model_id, messages=messages, max_tokens=40, temperature=0)
    assert r.object == "chat.completion" and r.model == model_id and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expect.text
    assert r.choices[0].finish_reason == openai_finish(expect.finish_reason)
    assert r.usage.prompt_tokens == len(chat_ids(ref, messages))
    assert r.usage.completion_tokens == len(expect.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    tri = r.triforce
    assert tri["mode"] == "auto" and tri["generated_tokens"] == len(expect.token_ids)
    assert tri["timed_out"] is False and tri["queue_seconds"] >= 0 and "target" in tri["tiers"]


def test_chat_streaming_equals_non_streaming(client, ref):
    messages = [{"role": "user", "content": "Tell me a story."}]
    expect = ref_chat(ref, messages, 48)
    chunks = list(client.chat.completions.create(model=client.models.list().data[0].id, messages=messages,
                                                 max_tokens=48, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expect.text
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == openai_finish(expect.finish_reason)
    assert finals[0].triforce["generated_tokens"] == len(expect.token_ids)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expect.token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_string_and_token_ids(client, ref):
    model = client.models.list().data[0].id
    prompt = "the quick brown fox"
    ids = ref.encode(prompt)
    expect = ref.generate(ids, max_new_tokens=32, sampling=GREEDY)
    r = client.completions.create(model=model, prompt=prompt, max_tokens=32, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text == expect.text
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(expect.token_ids)
    r = client.completions.create(model=model, prompt=ids, max_tokens=32, temperature=0)
    assert r.choices[0].text == expect.text and r.choices[0].finish_reason == openai_finish(expect.finish_reason)
    chunks = list(client.completions.create(model=model, prompt=ids, max_tokens=32, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expect.text
    assert chunks[-1].choices[0].finish_reason == openai_finish(expect.finish_reason)
    assert chunks[-1].usage is None  # no include_usage: no usage chunk


def test_logprobs_on_chat_streamed_and_not_equal_the_models(client, ref):
    """logprobs / top_logprobs through the official client: the values the library reports (themselves equal to
    transformers' log-softmax, tests/test_logprobs.py), the token strings the tokenizer decodes, and the same entries
    streamed as in one answer."""
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "Spell a word."}]
    expect = ref.generate(chat_ids(ref, messages), max_new_tokens=12,
                          sampling=SamplingParams(temperature=0, logprobs=5))
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0, logprobs=True,
                                       top_logprobs=5)
    content = r.choices[0].logprobs.content
    assert len(content) == len(expect.token_ids)
    for got, want in zip(content, expect.logprobs):
        assert got.token == ref.tokenizer.decode([want.token_id]) and got.bytes == list(got.token.encode())
        assert got.logprob == pytest.approx(want.logprob, abs=1e-5)
        assert [t.token for t in got.top_logprobs] == [ref.tokenizer.decode([i]) for i, _ in want.top]
        assert [t.logprob for t in got.top_logprobs] == pytest.approx([v for _, v in want.top], abs=1e-5)
    chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0,
                                                 logprobs=True, top_logprobs=5, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    # the second request reuses the first one's prompt KV (prefix reuse, a prefill chunked differently): equal to
    # rounding, not bitwise
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-5)
    plain = client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


def test_echo_scores_a_prompt_as_a_harness_does(client, ref):
    """lm-evaluation-harness's loglikelihood request: echo, logprobs, max_tokens 0 on /v1/completions."""
    model = client.models.list().data[0].id
    prompt = "the cat sat on the mat"
    ids = ref.encode(prompt)
    want = ref.prompt_logprobs(ids, 2)
    r = client.completions.create(model=model, prompt=prompt, echo=True, logprobs=2, max_tokens=0, temperature=0)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == prompt and r.usage.completion_tokens == 0
    assert lp.tokens == [ref.tokenizer.decode([i]) for i in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx([w.logprob for w in want[1:]], abs=1e-5)
    # the 2 most likely, and the token's own entry where it is not among them (OpenAI's legacy format: up to K + 1)
    assert all(len(t) <= 3 and t[tok] == v for t, tok, v in zip(lp.top_logprobs[1:], lp.tokens[1:],
                                                                 lp.token_logprobs[1:]))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    # echo with a completion, streamed: the prompt and its scores come first, then the completion's tokens
    expect = ref.generate(ids, max_new_tokens=6, sampling=SamplingParams(temperature=0, logprobs=0))
    chunks = list(client.completions.create(model=model, prompt=prompt, echo=True, logprobs=0, max_tokens=6,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == prompt + expect.text
    values = [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert values[:len(ids)] == lp.token_logprobs
    assert values[len(ids):] == pytest.approx([e.logprob for e in expect.logprobs], abs=1e-5)
    # a stop string holds text back while it may be starting: the offsets still say where each token's text starts
    stop = expect.text[3:5]
    r = client.completions.create(model=model, prompt=prompt, logprobs=0, max_tokens=6, temperature=0, stop=[stop])
    got = r.choices[0].logprobs
    assert r.choices[0].text == expect.text[:expect.text.index(stop)]
    assert got.text_offset == [sum(len(t) for t in got.tokens[:i]) for i in range(len(got.tokens))]


def test_stop_strings_and_seeded_sampling(client, ref):
    model = client.models.list().data[0].id
    full = ref.generate("abc", max_new_tokens=40, sampling=GREEDY).text
    stop = full[8:10]
    cut = full[:full.find(stop)]
    r = client.completions.create(model=model, prompt="abc", max_tokens=40, temperature=0, stop=stop)
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model=model, prompt="abc", max_tokens=40, temperature=0, stop=["\x7c\x7c", stop])
    assert r.choices[0].text == cut
    # server default sampling (temperature 0.6) with a seed: reproducible, and the seed is reported
    a = client.completions.create(model=model, prompt="abc", max_tokens=20, seed=1234)
    b = client.completions.create(model=model, prompt="abc", max_tokens=20, seed=1234)
    assert a.choices[0].text == b.choices[0].text and a.triforce["seed"] == 1234
    c = client.completions.create(model=model, prompt="abc", max_tokens=20, temperature=1.0, top_p=0.5, seed=7)
    assert c.usage.completion_tokens >= 1


# ------------------------------------------------------------------------------------------------ concurrency
def test_eight_concurrent_clients_get_their_own_answers(server, ref):
    model = httpx.get(server + "/v1/models").json()["data"][0]["id"]
    prompts = [f"client {i} asks: what is {i} plus {i}?" for i in range(8)]
    expected = [ref_chat(ref, [{"role": "user", "content": p}], 40) for p in prompts]

    def ask(i):
        c = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=60)
        messages = [{"role": "user", "content": prompts[i]}]
        if i % 2:
            chunks = list(c.chat.completions.create(model=model, messages=messages, max_tokens=40, temperature=0,
                                                    stream=True))
            return "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        return c.chat.completions.create(model=model, messages=messages, max_tokens=40, temperature=0
                                         ).choices[0].message.content

    forwards = metric(server, "triforce_forwards_total")
    rows = metric(server, "triforce_forward_sequences_total")
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(8)))
    assert answers == [e.text for e in expected]
    health = httpx.get(server + "/health").json()
    assert health["queue_depth"] == 0 and health["max_batch"] == 8
    # continuous batching: the eight requests shared forwards (more sequences' forwards than forwards)
    forwards = metric(server, "triforce_forwards_total") - forwards
    rows = metric(server, "triforce_forward_sequences_total") - rows
    assert rows > 1.5 * forwards > 0


def test_disconnect_mid_stream_then_next_request_is_exact_and_the_batch_empties(server, client, ref):
    """A client leaves a 480-token stream after two chunks: the next request gets its exact answer, and the left
    generation leaves the batch (nothing runs or waits afterwards)."""
    model = client.models.list().data[0].id
    prompt = long_prompt(ref, 300)
    with httpx.Client(timeout=30) as h:
        with h.stream("POST", server + "/v1/completions",
                      json={"model": model, "prompt": prompt, "max_tokens": 480, "temperature": 0,
                            "stream": True}) as r:
            assert r.status_code == 200
            seen = 0
            for line in r.iter_lines():
                if line.startswith("data: "):
                    seen += 1
                    if seen == 2:
                        break
    expect = ref.generate("abc", max_new_tokens=8, sampling=GREEDY)
    out = client.completions.create(model=model, prompt="abc", max_tokens=8, temperature=0)
    assert out.choices[0].text == expect.text
    wait_idle(server)
    assert metric(server, "triforce_requests_running") == 0 and metric(server, "triforce_queue_depth") == 0
    assert httpx.get(server + "/health").status_code == 200


# ------------------------------------------------------------------------------------------------ validation
C, CH = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]


def _chat(**kw):
    return dict({"messages": MSG, "max_tokens": 4}, **kw)


def _cmpl(**kw):
    return dict({"prompt": "hi", "max_tokens": 4}, **kw)


MALFORMED = [
    # (path, body (bytes: raw), status, param ("<any>": not checked))
    (CH, b"", 400, None),
    (CH, b"{", 400, None),
    (CH, b"not json", 400, None),
    (CH, b'{"messages": [}', 400, None),
    (CH, b"\xff\xfe\x00{", 400, None),
    (C, '{"prompt": "caf\u00e9"}'.encode("latin-1"), 400, None),
    (CH, b"[]", 400, None),
    (CH, b'"a string"', 400, None),
    (CH, b"null", 400, None),
    (C, b'{"prompt": "hi", "temperature": NaN}', 400, None),
    (C, b'{"prompt": "hi", "max_tokens": Infinity}', 400, None),
    (CH, {}, 400, "messages"),
    (CH, {"messages": []}, 400, "messages"),
    (CH, {"messages": "hi"}, 400, "messages"),
    (CH, {"messages": ["hi"]}, 400, "messages[0]"),
    (CH, {"messages": [{"content": "hi"}]}, 400, "messages[0].role"),
    (CH, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    (CH, {"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    (CH, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    (CH, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages[0].content[0]"),
    (CH, {"messages": [{"role": "function", "content": "x", "name": "f"}]}, 400, "messages[0].role"),
    (CH, {"messages": [{"role": "tool", "content": "x", "tool_call_id": 1}]}, 400, "messages[0].tool_call_id"),
    (CH, {"messages": MSG + [{"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}]}, 400,
     "messages[1].tool_calls"),
    (CH, {"messages": [{"role": "user", "content": "hi", "name": 5}]}, 400, "messages[0].name"),
    (CH, {"messages": [{"role": "user", "content": "hi", "weird": "x"}]}, 400, "messages[0].weird"),
    (CH, {"messages": [{"role": "user", "content": "x" * 600}]}, 400, "messages"),
    (CH, _chat(n=0), 400, "n"),
    (CH, _chat(n=17), 400, "n"),
    (CH, _chat(n="1"), 400, "n"),
    (CH, _chat(logprobs=1), 400, "logprobs"),
    (CH, _chat(logprobs="yes"), 400, "logprobs"),
    (CH, _chat(top_logprobs=2), 400, "top_logprobs"),  # without logprobs true
    (CH, _chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    (CH, _chat(logprobs=True, top_logprobs=-1), 400, "top_logprobs"),
    (CH, _chat(echo=True), 400, "echo"),
    (CH, _chat(presence_penalty=0.5), 400, "presence_penalty"),
    (CH, _chat(frequency_penalty=-1), 400, "frequency_penalty"),
    (CH, _chat(logit_bias={"5": 10}), 400, "logit_bias"),
    (CH, _chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools"),
    (CH, _chat(tool_choice="auto"), 400, "tool_choice"),
    (CH, _chat(functions=[{"name": "f"}]), 400, "functions"),
    (CH, _chat(response_format={"type": "yaml"}), 400, "response_format"),
    (CH, _chat(response_format={"type": "regex", "regex": "[ab"}), 400, "response_format"),
    (CH, _chat(response_format={"type": "regex", "regex": "[a&&b]"}), 400, "response_format"),  # fails at its start
    (CH, _chat(prompt="x"), 400, "prompt"),
    (CH, _chat(foo=1), 400, "foo"),
    (CH, _chat(max_completion_tokens=0), 400, "max_completion_tokens"),
    (CH, _chat(max_completion_tokens=5), 400, "max_completion_tokens"),  # together with max_tokens
    (CH, _chat(model="nope"), 404, "model"),
    (CH, _chat(stream=True, max_tokens=0), 400, "max_tokens"),
    (C, _cmpl(echo="yes"), 400, "echo"),
    (C, _cmpl(best_of=3), 400, "best_of"),
    (C, _cmpl(logprobs=21), 400, "logprobs"),
    (C, _cmpl(logprobs=True), 400, "logprobs"),
    (C, _cmpl(logprobs=-1), 400, "logprobs"),
    (C, _cmpl(echo=True, max_tokens=-1), 400, "max_tokens"),
    (C, _cmpl(n=3, echo=True), 400, "n"),
    (C, _cmpl(n=2.0), 400, "n"),
    (C, _cmpl(suffix="x"), 400, "suffix"),
    (C, _cmpl(messages=MSG), 400, "messages"),
    (C, _cmpl(tools=[]), 400, "tools"),
    (C, {"max_tokens": 4}, 400, "prompt"),
    (C, _cmpl(prompt=5), 400, "prompt"),
    (C, _cmpl(prompt=[]), 400, "prompt"),
    (C, _cmpl(prompt=[1, "a"]), 400, "prompt"),
    (C, _cmpl(prompt=[1, 100000]), 400, "prompt"),
    (C, _cmpl(prompt=[-1]), 400, "prompt"),
    (C, _cmpl(prompt=["a", "b"]), 400, "prompt"),
    (C, _cmpl(prompt=[[1, 2], [3]]), 400, "prompt"),
    (C, _cmpl(prompt={"text": "x"}), 400, "prompt"),
    (C, _cmpl(prompt="x" * 600), 400, "prompt"),
    (C, _cmpl(max_tokens=0), 400, "max_tokens"),
    (C, _cmpl(max_tokens=-5), 400, "max_tokens"),
    (C, _cmpl(max_tokens="10"), 400, "max_tokens"),
    (C, _cmpl(max_tokens=1.5), 400, "max_tokens"),
    (C, _cmpl(max_tokens=True), 400, "max_tokens"),
    (C, _cmpl(max_tokens=10 ** 12), 400, "max_tokens"),
    (C, _cmpl(max_tokens=511), 400, "max_tokens"),  # 2 prompt tokens + 511 > the context of 512
    (C, _cmpl(temperature=-0.1), 400, "temperature"),
    (C, _cmpl(temperature=2.5), 400, "temperature"),
    (C, _cmpl(temperature="hot"), 400, "temperature"),
    (C, _cmpl(temperature=None, top_p=0), 400, "top_p"),
    (C, _cmpl(top_p=1.5), 400, "top_p"),
    (C, _cmpl(top_p=-0.5), 400, "top_p"),
    (C, _cmpl(top_p="x"), 400, "top_p"),
    (C, _cmpl(top_k=-1), 400, "top_k"),
    (C, _cmpl(top_k=1.5), 400, "top_k"),
    (C, _cmpl(seed="abc"), 400, "seed"),
    (C, _cmpl(seed=-1), 400, "seed"),
    (C, _cmpl(seed=2 ** 70), 400, "seed"),
    (C, _cmpl(stop=5), 400, "stop"),
    (C, _cmpl(stop=["a", 1]), 400, "stop"),
    (C, _cmpl(stop=""), 400, "stop"),
    (C, _cmpl(stop=["a", "b", "c", "d", "e"]), 400, "stop"),
    (C, _cmpl(stream="yes"), 400, "stream"),
    (C, _cmpl(stream_options={"include_usage": True}), 400, "stream_options"),
    (C, _cmpl(stream=True, stream_options="x"), 400, "stream_options"),
    (C, _cmpl(stream=True, stream_options={"foo": 1}), 400, "stream_options.foo"),
    (C, _cmpl(model=5), 400, "model"),
    (C, _cmpl(model="gpt-4"), 404, "model"),
    (C, _cmpl(stream=True, temperature=-1), 400, "temperature"),
]


def test_malformed_requests_get_openai_errors_and_the_server_stays_healthy(server):
    assert len(MALFORMED) >= 50
    with httpx.Client(base_url=server, timeout=30) as h:
        for path, body, status, param in MALFORMED:
            raw = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = h.post(path, content=raw, headers={"content-type": "application/json"})
            err = assert_error_shape(r, status, param)
            if status == 400:
                assert err["type"] == "invalid_request_error", err
        assert_error_shape(h.post(C, content=b"x" * (17 * 1024 * 1024)), 413)
        assert_error_shape(h.get("/v1/models/nope"), 404)
        assert_error_shape(h.post("/v1/nothing", json={}), 404)
        assert_error_shape(h.get(C), 405)
        assert h.get("/health").status_code == 200
        ok = h.post(C, json=_cmpl(temperature=0))
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
    metrics = httpx.get(server + "/metrics").text
    assert re.search(r'triforce_requests_total\{endpoint="/v1/completions",status="400"\} [1-9]', metrics)
    assert re.search(r'triforce_requests_total\{endpoint="/v1/chat/completions",status="404"\} [1-9]', metrics)


def test_openai_client_sees_bad_request(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=client.models.list().data[0].id, messages=MSG, n=17)
    assert e.value.status_code == 400 and e.value.body["param"] == "n"


# ------------------------------------------------------------------------------------------------ structured output
def test_response_format_constrains_every_choice_and_equals_the_library(client, ref):
    pytest.importorskip("llguidance")
    model = client.models.list().data[0].id
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 1,
              "maxItems": 3, "x-guidance": {"whitespace_flexible": False}}
    r = client.chat.completions.create(model=model, messages=MSG, max_tokens=16, temperature=0.9, seed=3, n=4,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "numbers", "schema": schema}})
    for c in r.choices:
        if c.finish_reason == "stop":  # ended (EOS): a whole array of the schema
            value = json.loads(c.message.content)
            assert isinstance(value, list) and 1 <= len(value) <= 3 and all(0 <= x <= 99 for x in value)
        else:
            assert c.message.content.startswith("["), c.message.content
    regex = {"type": "regex", "regex": "[0-9]{3}"}  # then only EOS
    r = client.completions.create(model=model, prompt="abc", max_tokens=10, temperature=0,
                                  extra_body={"response_format": regex})
    assert re.fullmatch("[0-9]{3}", r.choices[0].text) and r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == ref.generate("abc", max_new_tokens=10, sampling=GREEDY, response_format=regex).text


# ------------------------------------------------------------------------------------------------ n choices
def test_n_choices_share_the_prefill_and_equal_requests_seeded_one_by_one(client, ref):
    model = client.models.list().data[0].id
    prompt = ref.encode("n choices: a prompt no other test sends, long enough that its prefill is shared " * 3)
    r = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0.9, seed=41, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.text for c in r.choices]
    assert len(set(texts)) > 1, texts  # independent samples (seeds 41-43 draw different ones on this model)
    stats = r.triforce["choices"]
    assert [s["seed"] for s in stats] == [41, 42, 43]
    assert r.usage.completion_tokens == sum(s["generated_tokens"] for s in stats)
    assert r.usage.prompt_tokens == len(prompt)
    # the first choice prefilled the prompt; the others adopted its KV and fed only the last prompt token
    assert stats[0]["tiers"]["target"]["reused_prefix_tokens"] < len(prompt) - 1
    assert [s["tiers"]["target"]["reused_prefix_tokens"] for s in stats[1:]] == [len(prompt) - 1] * 2
    # choice i is the request with seed 41 + i alone (the same tokens: a reused prefix is exact)
    for i, text in enumerate(texts):
        alone = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0.9, seed=41 + i)
        assert alone.choices[0].text == text, i


def test_n_choices_stream_by_index_and_equal_the_non_streamed_answer(client):
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "Name two colours, for the streamed n test."}]
    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=10, seed=5, n=2)
    parts, finish, usage = ["", ""], [None, None], None
    for ch in client.chat.completions.create(model=model, messages=messages, max_tokens=10, seed=5, n=2,
                                             stream=True, stream_options={"include_usage": True}):
        for c in ch.choices:
            parts[c.index] += c.delta.content or ""
            finish[c.index] = c.finish_reason or finish[c.index]
        usage = ch.usage or usage
    assert parts == [c.message.content for c in whole.choices]
    assert finish == [c.finish_reason for c in whole.choices]
    assert usage.completion_tokens == whole.usage.completion_tokens


# ------------------------------------------------------------------------------------------------ prefix reuse
def test_second_chat_turn_reuses_the_prefix_and_matches_a_cold_run(client, ref):
    model = client.models.list().data[0].id
    turn1 = [{"role": "system", "content": "You answer in one line."},
             {"role": "user", "content": "Tell me about foxes."}]
    # end turn 1 early with a stop string taken from its greedy output (as an EOS would), so that the second turn
    # (history + answer + new question) still fits in the KV cache sized for turn 1's max_tokens
    full = ref_chat(ref, turn1, 200).text
    stop = next(full[k:k + 2] for k in range(10, len(full) - 2) if full.find(full[k:k + 2]) >= 5)
    answer = full[:full.find(stop)]
    r1 = client.chat.completions.create(model=model, messages=turn1, max_tokens=200, temperature=0, stop=stop)
    assert r1.choices[0].message.content == answer and r1.choices[0].finish_reason == "stop"
    turn2 = turn1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And wolves?"}]
    r2 = client.chat.completions.create(model=model, messages=turn2, max_tokens=30, temperature=0)
    reused = r2.triforce["tiers"]["target"]["reused_prefix_tokens"]
    assert reused >= len(chat_ids(ref, turn1)), reused
    cold = ref_chat(ref, turn2, 30)
    assert r2.choices[0].message.content == cold.text
    assert r2.usage.completion_tokens == len(cold.token_ids)


def test_prefix_cache_is_bounded_by_bytes_and_evicts_the_least_recently_used(tiny_folder):
    from triforce.kv.caches import FullKVCache
    from triforce.serve.metrics import ServerMetrics
    from triforce.serve.worker import GenerationWorker

    tf = TriForce.load(tiny_folder)
    one = FullKVCache(tf.target.model.cfg, 64).nbytes
    assert one == 2 * tf.target.model.cfg.num_hidden_layers * tf.target.model.cfg.num_key_value_heads * 64 \
        * tf.target.model.cfg.head_dim * 4  # K and V, fp32
    worker = GenerationWorker(tf, 4, ServerMetrics(), SpeculationConfig(), max_batch=4,
                              prefix_cache_bytes=int(2.5 * one))
    for first in range(4):  # four finished requests, prompts [first, 100, 101, ...], oldest first
        view = tf.fork()  # (a running request would take an idle view: there are none yet)
        tokens = [first] + list(range(100, 110))
        cache = FullKVCache(tf.target.model.cfg, 64)
        cache.length = len(tokens)  # as if the request had processed them
        view.engine.adopt_prefix(cache, tokens)
        worker._keep(view)
    kept = [v.engine.prefix_tokens[:1] for v in worker._idle_views]
    assert kept == [[], [], [2], [3]], kept  # 2 caches fit in 2.5: the two least recently used were dropped
    assert worker.kept_cache_bytes == 2 * one == worker.metrics.prefix_cache_bytes._value.get()
    assert worker._take_view([2, 100, 101]).engine.prefix_tokens[:1] == [2]  # the longest shared prefix
    assert worker._take_view([9]).engine.full_cache is None  # no match: the least recently used
    # a bound of 0 keeps only the last request's cache, even when larger than the bound
    worker.prefix_cache_bytes = 0
    big = tf.fork()
    big.engine.adopt_prefix(FullKVCache(tf.target.model.cfg, 640), [])
    worker._keep(big)
    assert [v.engine.full_cache is big.engine.full_cache for v in worker._idle_views if v.engine.full_cache] == [True]
    with pytest.raises(ValueError, match="prefix_cache_gib"):
        ServerDefaults(prefix_cache_gib=-1)


# ------------------------------------------------------------------------------------------------ metrics
def test_metrics_in_prometheus_format(server, client):
    client.completions.create(model=client.models.list().data[0].id, prompt="abc", max_tokens=5, temperature=0)
    text = httpx.get(server + "/metrics").text
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("triforce_requests", "triforce_generated_tokens", "triforce_request_latency_seconds",
                 "triforce_queue_depth", "triforce_time_to_first_token_seconds", "triforce_requests_running"):
        assert name in families, name
    assert metric(server, "triforce_generated_tokens_total") >= 5
    assert metric(server, "triforce_requests_total", 'endpoint="/v1/completions",status="200"') >= 1
    assert metric(server, "triforce_request_latency_seconds_count", 'endpoint="/v1/completions"') >= 1
    assert metric(server, "triforce_queue_depth") == 0


# ------------------------------------------------------------------------------------------------ slow server
def test_disconnect_cancels_the_generation_promptly(slow_server, ref):
    """Promptly, in tokens: at 10 ms or more a token, a 400-token answer whose client leaves after two chunks (or
    gives up on a non-streamed answer after 0.3 s) ends early with fewer than 100 (180) tokens generated, and the
    next request runs alone on the only slot (max_batch=1): the cancelled ones generate nothing more."""
    url, _ = slow_server
    wait_idle(url)
    prompt = long_prompt(ref, 400)
    cancelled = metric(url, "triforce_generations_ended_early_total", 'reason="disconnect"')
    generated = metric(url, "triforce_generated_tokens_total")
    with httpx.Client(timeout=30) as h:
        with h.stream("POST", url + "/v1/completions",
                      json={"prompt": prompt, "max_tokens": 400, "stream": True}) as r:  # 400 tokens: 4+ s
            assert r.status_code == 200
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data: ")
                if seen == 2:
                    break
    wait_until(lambda: metric(url, "triforce_generations_ended_early_total", 'reason="disconnect"') > cancelled,
               "the generation was not cancelled")
    wait_idle(url)  # the generation's tokens are counted once it has left
    assert metric(url, "triforce_generated_tokens_total") - generated < 100
    # a client that gives up on a non-streamed answer cancels it too
    generated = metric(url, "triforce_generated_tokens_total")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 400}, timeout=0.3)
    wait_until(lambda: metric(url, "triforce_generations_ended_early_total", 'reason="disconnect"') >= cancelled + 2,
               "the non-streamed generation was not cancelled")
    wait_idle(url)
    assert metric(url, "triforce_generated_tokens_total") - generated < 180
    generated = metric(url, "triforce_generated_tokens_total")
    r = httpx.post(url + "/v1/completions", json={"prompt": "abc", "max_tokens": 5}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    assert metric(url, "triforce_generated_tokens_total") - generated == r.json()["usage"]["completion_tokens"]


def test_full_queue_answers_503_with_retry_after(slow_server, ref):
    url, _ = slow_server  # queue_size=1: one running, one waiting, the third is refused
    wait_idle(url)
    prompt = long_prompt(ref, 400)
    waiting = {}
    with httpx.Client(timeout=30) as h:
        with h.stream("POST", url + "/v1/completions",
                      json={"prompt": prompt, "max_tokens": 400, "stream": True}) as running:
            assert running.status_code == 200
            lines = running.iter_lines()  # keep the iterator: closing it would close the connection
            while not next(lines).startswith("data: "):
                pass
            second = threading.Thread(target=lambda: waiting.setdefault(
                "r", httpx.post(url + "/v1/completions", json={"prompt": "abc", "max_tokens": 3}, timeout=30)))
            second.start()
            wait_until(lambda: httpx.get(url + "/health").json()["queue_depth"] >= 1, "the second request was not "
                       "queued", every=0.005)  # the running stream still runs: the third finds the queue full
            third = httpx.post(url + "/v1/chat/completions", json={"messages": MSG, "max_tokens": 3}, timeout=10)
            err = assert_error_shape(third, 503)
            assert err["code"] == "queue_full" and err["type"] == "server_error"
            assert int(third.headers["retry-after"]) >= 1
    second.join(10)
    assert waiting["r"].status_code == 200, waiting["r"].text
    assert metric(url, "triforce_requests_total", 'endpoint="/v1/chat/completions",status="503"') == 1


def test_request_timeout_ends_the_generation_with_length(slow_server, ref):
    url, _ = slow_server  # request_timeout=2 s, 10 ms per token
    wait_idle(url)
    prompt = long_prompt(ref, 400)
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 400}, timeout=30)
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["choices"][0]["finish_reason"] == "length" and d["triforce"]["timed_out"] is True
    assert 10 < d["usage"]["completion_tokens"] < 400
    # ended at the timeout: each token takes at least 10 ms, so 2 s hold at most 200, and the check after the 201st
    # ends it
    assert d["usage"]["completion_tokens"] <= 201
    expect = ref.generate(prompt, max_new_tokens=400, sampling=GREEDY).text
    assert expect.startswith(d["choices"][0]["text"])
    wait_idle(url)


def test_fastapi_422_becomes_an_openai_400(slow_server):
    url, app = slow_server

    @app.get("/typed-for-test")
    async def typed(x: int):
        return {"x": x}

    assert httpx.get(url + "/typed-for-test?x=3").json() == {"x": 3}
    err = assert_error_shape(httpx.get(url + "/typed-for-test?x=abc"), 400, "x")
    assert err["type"] == "invalid_request_error"


# ------------------------------------------------------------------------------------------------ speculation
def test_triforce_mode_server_is_lossless_under_greedy(tiny_folder, tiny_draft_folder, ref):
    tf = TriForce.load(tiny_folder, draft=tiny_draft_folder)
    spec = SpeculationConfig(mode="triforce", budget=32, chunk_size=4, draft_window=16)
    app = create_app(tf, ServerDefaults(model_id="tri", temperature=0, spec=spec))
    messages = [{"role": "user", "content": "the quick brown fox jumps over the lazy dog " * 3}]
    expect = ref_chat(ref, messages, 40)
    with serve_in_thread(app) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        r = c.chat.completions.create(model="tri", messages=messages, max_tokens=40)
        chunks = list(c.chat.completions.create(model="tri", messages=messages, max_tokens=40, stream=True))
    assert r.choices[0].message.content == expect.text and r.usage.completion_tokens == len(expect.token_ids)
    assert r.triforce["mode"] == "triforce" and r.triforce["tiers"]["retrieval"]["verifications"] >= 1
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == expect.text


# ------------------------------------------------------------------------------------------------ command line
def test_bad_options_exit_2_before_loading(capsys):
    assert main_for_tests(["--queue-size", "0"]) == 2
    assert "--queue-size" in capsys.readouterr().err
    assert main_for_tests(["--request-timeout", "-1"]) == 2
    assert "--request-timeout" in capsys.readouterr().err
    assert main_for_tests(["--top-p", "0"]) == 2
    assert "--top-p" in capsys.readouterr().err
    assert main_for_tests(["--tp", "2"]) == 2
    assert "--tp: triforce serve runs in one process" in capsys.readouterr().err
    assert main_for_tests(["--on-chip-layers", "2"]) == 2
    assert "--on-chip-layers needs --offload-kv" in capsys.readouterr().err
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    try:
        assert main_for_tests(["--port", str(busy.getsockname()[1]), "--model", "/nonexistent"]) == 2
        assert "cannot listen" in capsys.readouterr().err
    finally:
        busy.close()
