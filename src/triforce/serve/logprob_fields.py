"""``triforce serve``: log-probabilities in OpenAI's response formats (values from ``speculation/logprobs.py``).

Two formats (OpenAI API reference, and what llama-server and vLLM return):

* chat completions: ``choices[i].logprobs = {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
  "logprob", "bytes"}]}]}``; a streamed chunk carries the entries of the tokens whose text it carries;
* completions (the legacy format lm-evaluation-harness reads): ``{"tokens": [str], "token_logprobs": [float or
  null], "top_logprobs": [{token: logprob} or null], "text_offset": [int]}``; with ``echo`` the prompt's tokens come
  first, the very first with null (nothing predicts it).

A token's string is the tokenizer's decoding of that token alone (a token holding part of a UTF-8 character decodes
to U+FFFD, as llama-server's and vLLM's token strings do); ``bytes`` are the token's own bytes where the tokenizer
says them (byte-level BPE: GPT-2's byte-to-character table, as Llama 3, Qwen2 and SmolLM2 use; SentencePiece's
``<0xNN>`` byte tokens), else the string's UTF-8 bytes. ``text_offset`` counts characters of the returned text
before each token, from decoding the tokens one by one (``text/detok.py``: a token that completes no character yet adds
none; the echoed prompt keeps its special tokens, the completion skips them as its text does). Tokens past a stop
string keep counting beyond the text, which is cut before it.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from ..speculation.logprobs import TokenLogprob


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {c: b for b, c in bytes_to_unicode().items()}


def token_bytes(tokenizer, token_id: int) -> list[int]:
    """The bytes of one token (module docstring)."""
    piece = tokenizer.convert_ids_to_tokens(int(token_id))
    if isinstance(piece, str):
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        table = _byte_decoder()
        if type(decoder).__name__ == "ByteLevel" and all(c in table for c in piece):
            return [table[c] for c in piece]
        if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):
            return [int(piece[3:5], 16)]
    return list(tokenizer.decode([token_id]).encode("utf-8"))


def describe(tokenizer, entry: "TokenLogprob | None", token_id: int | None = None) -> dict:
    """One token's entry in the chat format (``{"token", "logprob", "bytes", "top_logprobs"}``); ``entry`` None
    (the prompt's first token, ``token_id``): its string with logprob None."""
    def one(tid: int, logprob: float | None) -> dict:
        return {"token": tokenizer.decode([tid]), "logprob": logprob, "bytes": token_bytes(tokenizer, tid)}

    if entry is None:
        return dict(one(token_id, None), top_logprobs=[])
    d = one(entry.token_id, entry.logprob)
    d["top_logprobs"] = [one(t, lp) for t, lp in entry.top]
    return d


def chat_logprobs(entries: list[tuple[dict, str]]) -> dict:
    """``{"content": [entry, ...]}`` of ``(entry, piece)`` pairs (:func:`completion_logprobs`)."""
    return {"content": [e for e, _ in entries]}


def completion_logprobs(entries: list[tuple[dict, str]], offset: int = 0) -> tuple[dict, int]:
    """The completions format of ``entries``: ``(entry, piece)`` pairs, :func:`describe`'s entry and the text the
    token added to the returned text; offsets start at ``offset`` characters. Returns ``(logprobs object, offset
    after the last token)``."""
    tokens, values, tops, offsets = [], [], [], []
    for e, piece in entries:
        offsets.append(offset)
        tokens.append(e["token"])
        values.append(e["logprob"])  # None for the prompt's first token: nothing predicts it
        top = None if e["logprob"] is None else {t["token"]: t["logprob"] for t in e["top_logprobs"]}
        if top is not None:  # OpenAI's legacy format: the token's own entry is always there (up to K + 1)
            top.setdefault(e["token"], e["logprob"])
        tops.append(top)
        offset += len(piece)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}, offset
