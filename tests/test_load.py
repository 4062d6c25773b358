"""Load test of the batched server (issue: many users at once), with the official ``openai`` client.

16 concurrent clients stream greedy chat completions of mixed prompt lengths from a ``triforce serve`` subprocess
(``--max-batch 8``, the tiny model), while some clients disconnect mid-stream and malformed requests are mixed in.
The clients are served together (their sequences share batched forwards). Every completed stream equals the same
request generated alone in this process; no state leaks between requests (each answer is its own); the server stays
healthy; and running the whole load a second time leaves the server's resident memory within 10% of what the first
run left (no growth per request: the kept prefix caches are bounded by ``--max-batch``). Marked slow (about 20 s
here); CI runs the eight-client variant in ``test_server.py``.
"""

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
psutil = pytest.importorskip("psutil")

from servers import chat_ids, metric, server_process, wait_idle  # noqa: E402
from triforce import SamplingParams, TriForce  # noqa: E402

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(temperature=0)
CLIENTS, NEW = 16, 24


@pytest.fixture(scope="module")
def batched_server(tiny_folder, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("load") / "server.log")
    with server_process(tiny_folder, log, "--max-batch", "8", "--queue-size", "32") as (url, proc):
        yield url, proc


def _messages(i: int) -> list[dict]:
    rng = random.Random(i)
    words = " ".join(rng.choice(["sea", "wind", "stone", "light", "rain", "salt", "iron"]) for _ in range(rng.choice(
        [1, 4, 20, 50, 70])))
    return [{"role": "user", "content": f"client {i}: {words}"}]


def _load(url: str, model: str) -> dict:
    """One round of the load; returns what every client saw."""
    results: dict = {}

    def client(i: int):
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        if i % 7 == 3:  # malformed requests mixed in: each gets a 400, never a 500
            bad = [{"messages": "not a list"}, {"messages": [{"role": "user", "content": "x"}], "max_tokens": -1},
                   {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}][i % 3]
            r = httpx.post(url + "/v1/chat/completions", json=bad, timeout=30)
            results[i] = ("bad", r.status_code)
            return
        stream = c.chat.completions.create(model=model, messages=_messages(i), max_tokens=NEW, temperature=0,
                                           stream=True)
        text = []
        for n, chunk in enumerate(stream):
            if chunk.choices:
                text.append(chunk.choices[0].delta.content or "")
            if i % 5 == 1 and n == 3:  # disconnect mid-stream
                stream.close()
                results[i] = ("left", None)
                return
        results[i] = ("done", "".join(text))

    with ThreadPoolExecutor(CLIENTS) as pool:
        futures = [pool.submit(client, i) for i in range(CLIENTS)]
        for f in futures:
            f.result(timeout=180)
    return results


def test_sixteen_concurrent_clients(batched_server, tiny_folder):
    url, proc = batched_server
    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    ref = TriForce.load(tiny_folder)
    expected = {i: ref.fork().generate(chat_ids(ref, _messages(i)), max_new_tokens=NEW, sampling=GREEDY).text
                for i in range(CLIENTS)}
    rss = []
    for _ in range(2):
        forwards, rows = metric(url, "triforce_forwards_total"), metric(url, "triforce_forward_sequences_total")
        results = _load(url, model)
        for i, (kind, value) in results.items():
            if kind == "done":
                assert value == expected[i], i
            elif kind == "bad":
                assert value == 400, (i, value)
        assert sum(k == "done" for k, _ in results.values()) >= 8
        wait_idle(url)  # the disconnected requests leave the batch
        h = httpx.get(url + "/health", timeout=10).json()
        assert h["status"] == "ok" and h["running"] == 0 and h["queue_depth"] == 0
        # served together, not one after another: the clients' sequences shared batched forwards
        forwards = metric(url, "triforce_forwards_total") - forwards
        assert metric(url, "triforce_forward_sequences_total") - rows > 1.5 * forwards > 0
        rss.append(psutil.Process(proc.pid).memory_info().rss)
    assert rss[1] <= 1.10 * rss[0], rss
    # the server still answers a plain request exactly
    c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    out = c.chat.completions.create(model=model, messages=_messages(0), max_tokens=NEW, temperature=0)
    assert out.choices[0].message.content == expected[0]
