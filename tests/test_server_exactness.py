"""Batch invariance through the server (issue 47, item 3): a request's greedy tokens do not depend on the requests
served beside it.

The near-tie models of ``near_tie.py`` (the best two logits about 1e-6 apart at every position, so any
difference in rounding between a request alone and in a batch flips greedy tokens) behind the server's app, with
continuous batching up to 8 sequences. 32 completions requests (token-id prompts of 3-62 tokens) are sent one at a
time, then in concurrent groups of 2, 4 and 8: every answer must be the answer alone, token for token (text,
token count, finish reason; the tokenizer is character-level, one character a token), and the metrics must show
that the groups shared forwards (more sequence-forwards than forwards), so the batched path really ran. Mode: the
full hierarchy (a draft model over a StreamingLLM cache, the retrieval tier, the target); autoregressive decoding's
batches are checked through the API in test_exactness.py.
"""

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from near_tie import GREEDY_NEW, near_tie_pair, random_ids  # noqa: E402
from servers import metric, serve_in_thread  # noqa: E402
from tiny import char_tokenizer, hf_config  # noqa: E402
from triforce import SpeculationConfig, TriForce  # noqa: E402
from triforce.formats.loading import LoadedModel  # noqa: E402
from triforce.serve import ServerDefaults, create_app  # noqa: E402

VOCAB = 96  # the character tokenizer's: every token decodes to its own character
REQUESTS = 32
LENGTHS = [3 + (17 * i) % 60 for i in range(REQUESTS)]  # 3-62 tokens
#: the full hierarchy: every tier's forwards batched (autoregressive decoding's batches are test_exactness.py's (c))
MODES = {"triforce": dict(mode="triforce", budget=32, chunk_size=4, gamma1=2, gamma2=5)}


def _answer(url: str, prompt: list[int]) -> tuple:
    r = httpx.post(url + "/v1/completions", timeout=120,
                   json={"model": "near-tie", "prompt": prompt, "max_tokens": GREEDY_NEW, "temperature": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["text"], r.json()["usage"]["completion_tokens"], choice["finish_reason"]


@pytest.mark.parametrize("mode", list(MODES))
def test_32_requests_get_their_tokens_alone_and_in_batches_of_2_4_and_8(mode):
    target, draft = near_tie_pair(VOCAB, seed=11)
    tf = TriForce(LoadedModel(target, char_tokenizer(), hf_config(vocab=VOCAB), "near-tie target"),
                  LoadedModel(draft, char_tokenizer(), hf_config(vocab=VOCAB), "near-tie draft"))
    spec = SpeculationConfig(draft_sink=4, draft_window=12, **MODES[mode])
    app = create_app(tf, ServerDefaults(model_id="near-tie", temperature=0, spec=spec, max_batch=8, queue_size=64,
                                        prefix_cache_gib=0))
    prompts = [random_ids(n, VOCAB, 200 + i) for i, n in enumerate(LENGTHS)]
    with serve_in_thread(app) as url:
        alone = [_answer(url, p) for p in prompts]
        forwards, rows = metric(url, "triforce_forwards_total"), metric(url, "triforce_forward_sequences_total")
        differing = {}
        for size in (2, 4, 8):
            for start in range(0, REQUESTS, size):
                group = list(range(start, start + size))
                go = threading.Barrier(size)

                def ask(i, go=go):
                    go.wait()
                    return _answer(url, prompts[i])

                with ThreadPoolExecutor(size) as pool:
                    for i, got in zip(group, pool.map(ask, group)):
                        if got != alone[i]:
                            differing[f"request {i} ({LENGTHS[i]} tokens) in a group of {size}"] = (got, alone[i])
        forwards = metric(url, "triforce_forwards_total") - forwards
        rows = metric(url, "triforce_forward_sequences_total") - rows
    assert not differing, differing
    assert rows > 1.3 * forwards > 0, (rows, forwards)  # the groups were batched
