"""``triforce serve``: log-probabilities in OpenAI's response formats (values from ``logprobs.py``).

Two formats (OpenAI API reference, and what llama-server and vLLM return):

* chat completions: ``choices[i].logprobs = {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
  "logprob", "bytes"}]}]}``; a streamed chunk carries the entries of the tokens whose text it carries;
* completions (the legacy format lm-evaluation-harness reads): ``{"tokens": [str], "token_logprobs": [float or
  null], "top_logprobs": [{token: logprob} or null], "text_offset": [int]}``; with ``echo`` the prompt's tokens come
  first, the very first with null (nothing predicts it).

A token's string is the tokenizer's decoding of that token alone; ``bytes`` are its UTF-8 bytes (a token holding
part of a character decodes to U+FFFD, as with llama-server's and vLLM's token strings).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from ..logprobs import TokenLogprob


def describe(tokenizer, entry: "TokenLogprob | None", token_id: int | None = None) -> dict:
    """One token's entry in the chat format (``{"token", "logprob", "bytes", "top_logprobs"}``); ``entry`` None
    (the prompt's first token, ``token_id``): its string with logprob None."""
    def one(tid: int, logprob: float | None) -> dict:
        text = tokenizer.decode([tid])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    if entry is None:
        return dict(one(token_id, None), top_logprobs=[])
    d = one(entry.token_id, entry.logprob)
    d["top_logprobs"] = [one(t, lp) for t, lp in entry.top]
    return d


def chat_logprobs(entries: list[dict]) -> dict:
    """``{"content": entries}`` (entries from :func:`describe`)."""
    return {"content": list(entries)}


def completion_logprobs(entries: list[dict], offset: int = 0) -> tuple[dict, int]:
    """The completions format of ``entries`` (:func:`describe`'s), its text offsets starting at ``offset``
    characters; returns ``(logprobs object, offset after the last token)``."""
    tokens, values, tops, offsets = [], [], [], []
    for e in entries:
        offsets.append(offset)
        tokens.append(e["token"])
        values.append(e["logprob"])  # None for the prompt's first token: nothing predicts it
        tops.append(None if e["logprob"] is None else {t["token"]: t["logprob"] for t in e["top_logprobs"]})
        offset += len(e["token"])
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}, offset
