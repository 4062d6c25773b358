"""Incremental detokenization (issue 12, item 5): streamed text equals the full decode, in linear work.

The SmolLM2 tokenizer (byte-level BPE, loaded offline from ~/.cache/triforce; the tests that need it skip without it)
splits multi-byte characters over several tokens; random id sequences biased towards its 256 byte tokens (ids 17-272)
and its special tokens (ids 0-16) exercise incomplete characters, invalid byte runs and skipped special tokens.
"""

import os
import random

import pytest

from tiny import char_tokenizer
from triforce.api import TriForce
from triforce.engine import GenerationStats, SpeculationConfig
from triforce.speculation.sampling import SamplingParams
from triforce.text.detok import IncrementalDetokenizer

SMOL = os.path.join(os.environ.get("TRIFORCE_CACHE", os.path.expanduser("~/.cache/triforce")), "SmolLM2-135M-Instruct")
TEXT = "Hello wörld, 日本語 is fun. €5 and 🙂 too — naïve café, Ω ≈ ∑. 🙂🙂\n"
# per add: at most 3 decodes (the window; on a forced emission the window up to the cut; on emission the new prefix),
# each of at most 2 * MAX_HELD + 2 tokens (a prefix and the held tokens, each at most MAX_HELD + 1)
DECODE_LENGTH = 2 * IncrementalDetokenizer.MAX_HELD + 2
WORK_PER_TOKEN = 3 * DECODE_LENGTH


@pytest.fixture(scope="module")
def smol_tok():
    if not os.path.isfile(os.path.join(SMOL, "tokenizer.json")):
        pytest.skip(f"SmolLM2 tokenizer not in {SMOL}: run `triforce download` first")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(SMOL)


def _random_ids(rng, tok, n):
    """A mix: byte tokens, special tokens, pieces of multi-byte text, anything in the vocabulary."""
    text_ids = tok.encode(TEXT)
    out = []
    while len(out) < n:
        r = rng.random()
        if r < 0.35:
            out.append(rng.randrange(17, 273))
        elif r < 0.45:
            out.append(rng.randrange(0, 17))
        elif r < 0.7:
            i = rng.randrange(len(text_ids))
            out += text_ids[i:i + rng.randrange(1, 6)]
        else:
            out.append(rng.randrange(len(tok)))
    return out[:n]


def _stream(tok, ids):
    d = IncrementalDetokenizer(tok)
    pieces, work = [], []
    for t in ids:
        calls, decoded = d.decode_calls, d.decoded_tokens
        pieces.append(d.add(t))
        work.append((d.decode_calls - calls, d.decoded_tokens - decoded))
    pieces.append(d.flush())
    return pieces, work


def test_concatenated_text_equals_the_full_decode_for_random_ids(smol_tok):
    rng = random.Random(0)
    for case in range(300):
        ids = _random_ids(rng, smol_tok, rng.randrange(1, 80))
        pieces, work = _stream(smol_tok, ids)
        assert "".join(pieces) == smol_tok.decode(ids, skip_special_tokens=True), (case, ids)
        assert all(calls <= 3 and decoded <= WORK_PER_TOKEN for calls, decoded in work), (case, work)
        assert not any(p.endswith("\ufffd") for p in pieces[:-1] if p) or len(ids) > 8  # held until complete


def test_multibyte_characters_come_out_whole_once_complete(smol_tok):
    ids = smol_tok.encode(TEXT)
    pieces, _ = _stream(smol_tok, ids)
    assert "".join(pieces) == TEXT
    assert all("\ufffd" not in p for p in pieces)  # never a half character on the way
    assert "" in pieces[:-1]  # some token completed no character (the emoji's first bytes)


def test_work_stays_bounded_in_runs_of_invalid_bytes_and_special_tokens(smol_tok):
    """0x80 bytes never complete a character and skipped special tokens bring no text: text is still given out once
    more than MAX_HELD tokens are held, so the window does not grow with the output."""
    cont = smol_tok.convert_tokens_to_ids("Ģ")  # byte 0x80 in the byte-level alphabet (a lone continuation byte)
    ids = ([cont] * 200 + [1, 2, 0] * 50 + smol_tok.encode(TEXT)) * 2
    pieces, work = _stream(smol_tok, ids)
    assert max(decoded for _, decoded in work) <= WORK_PER_TOKEN
    assert sum(decoded for _, decoded in work) <= WORK_PER_TOKEN * len(ids)
    assert "".join(pieces) == smol_tok.decode(ids, skip_special_tokens=True)


def test_char_tokenizer_roundtrip():
    tok = char_tokenizer()
    rng = random.Random(1)
    for _ in range(50):
        ids = [rng.randrange(0, 96) for _ in range(rng.randrange(1, 40))]
        assert "".join(_stream(tok, ids)[0]) == tok.decode(ids, skip_special_tokens=True)


# --------------------------------------------------------------------------- TriForce.stream
class _ScriptedEngine:
    """Stands in for the engine: yields the given token ids, as Engine.stream does, and records its stats."""

    def __init__(self, ids, eos_ids=()):
        self.ids, self.eos_ids, self.last_stats, self.yielded = ids, tuple(eos_ids), None, 0

    def stream(self, prompt_ids, max_new_tokens=256, **kw):
        stats = GenerationStats(mode="autoregressive", prompt_tokens=len(prompt_ids), generated_tokens=0,
                                finish_reason="length", prefill_seconds=0.0, decode_seconds=0.0,
                                decode_tokens_per_second=0.0, mean_time_between_tokens_ms=0.0, peak_memory_bytes=0,
                                seed=0)
        try:
            for t in self.ids[:max_new_tokens]:
                self.yielded += 1
                stats.generated_tokens += 1
                yield t
        except GeneratorExit:
            stats.finish_reason = "stop"
            raise
        finally:
            self.last_stats = stats
        return stats


def _scripted(tok, ids):
    tf = object.__new__(TriForce)
    tf.tokenizer, tf.engine, tf.drafter, tf.draft, tf.prompt_cache = tok, _ScriptedEngine(ids), "model", None, None
    return tf


def _run(tf, stop):
    gen = tf.stream([1, 2, 3], max_new_tokens=10_000, spec=SpeculationConfig(), stop=stop)
    events = []
    while True:
        try:
            events.append(next(gen))
        except StopIteration as s:
            return events, s.value


def test_stop_strings_cut_the_text_like_the_full_decode(smol_tok):
    """Random id sequences, stop strings taken from their decoded text (multi-byte characters and spans over many
    tokens included): the text is the full decode cut right before a stop string, with no stop string before the
    cut, and the events add up to it. (With overlapping stop strings the one completed first wins, as it did when the
    whole output was decoded for every token: "ic" before "omic." in "comic.".)"""
    rng = random.Random(2)
    stopped = 0
    for case in range(150):
        ids = _random_ids(rng, smol_tok, rng.randrange(5, 60))
        full = smol_tok.decode(ids, skip_special_tokens=True)
        stops = []
        for _ in range(rng.randrange(0, 3)):
            if len(full) > 2:
                i = rng.randrange(len(full) - 1)
                stops.append(full[i:i + rng.randrange(1, 7)])
        stops = [s for s in stops if s] or (["\x00never"] if case % 2 else [])
        events, result = _run(_scripted(smol_tok, ids), stops)
        text = result.text
        assert "".join(e.text for e in events) == text
        if any(s in full for s in stops):
            assert full.startswith(text) and any(full[len(text):].startswith(s) for s in stops), (case, ids, stops)
            assert not any(s in text for s in stops) and result.finish_reason == "stop"
            stopped += 1
        else:
            assert text == full and result.finish_reason == "length", (case, ids, stops)
    assert stopped > 50


def test_stop_string_with_an_emoji_and_the_events_before_it(smol_tok):
    ids = smol_tok.encode(TEXT)
    tf = _scripted(smol_tok, ids)
    events, result = _run(tf, ["🙂 too"])
    assert result.text == TEXT[:TEXT.index("🙂 too")] == "".join(e.text for e in events)
    assert result.finish_reason == "stop" and tf.engine.last_stats.finish_reason == "stop"
    assert tf.engine.yielded < len(ids)  # generation stopped at the stop string
    assert all(e.token_id is not None for e in events)


class _CountingTokenizer:
    """Forwards to a tokenizer and records the length of every decode call."""

    def __init__(self, tok):
        self._tok, self.lengths = tok, []

    def decode(self, ids, **kw):
        self.lengths.append(len(ids))
        return self._tok.decode(ids, **kw)

    def __getattr__(self, name):
        return getattr(self._tok, name)


def test_streaming_a_real_generation_is_linear_and_exact(tiny_folder):
    """200 tokens from the tiny model: the text equals the full decode and the decode work is linear (re-decoding
    the output for every token, as before, costs 200 * 201 / 2 = 20,100 token decodes)."""
    tf = TriForce.load(tiny_folder)
    tf.engine.eos_ids = ()  # 200 tokens whatever they are
    tf.tokenizer = counting = _CountingTokenizer(tf.tokenizer)
    gen = tf.stream([5, 17, 33, 40], max_new_tokens=200, sampling=SamplingParams(temperature=1.0), seed=3)
    texts = []
    while True:
        try:
            texts.append(next(gen).text)
        except StopIteration as s:
            result = s.value
            break
    n = len(result.token_ids)
    assert n == 200 and result.finish_reason == "length"
    assert "".join(texts) == result.text == counting._tok.decode(result.token_ids, skip_special_tokens=True)
    assert max(counting.lengths) <= DECODE_LENGTH and sum(counting.lengths) <= 4 * n
