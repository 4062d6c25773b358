"""Turning user text into prompt token ids: Project Gutenberg stripping, chat templates, truncation."""

from __future__ import annotations

import re
from typing import Any

_START = re.compile(r"^\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG.*$", re.MULTILINE | re.IGNORECASE)
_END = re.compile(r"^\*\*\* ?END OF (THE|THIS) PROJECT GUTENBERG.*$", re.MULTILINE | re.IGNORECASE)


def strip_gutenberg(text: str) -> str:
    """Remove a Project Gutenberg header (up to the ``*** START OF`` line) and footer (from ``*** END OF``).

    Text without those markers is returned unchanged.
    """
    start = _START.search(text)
    if start:
        text = text[start.end():]
    end = _END.search(text)
    if end:
        text = text[:end.start()]
    return text.strip("\r\n") if (start or end) else text


def encode_prompt(tokenizer: Any, text: str, chat: bool = False, system: str | None = None,
                  max_prompt_tokens: int | None = None, context_length: int | None = None) -> list[int]:
    """Token ids of a prompt.

    Args:
        tokenizer: a transformers tokenizer.
        text: the prompt text (the user message when ``chat``).
        chat: wrap the text in the tokenizer's chat template (with a generation prompt).
        system: system message for the chat template (only with ``chat``).
        max_prompt_tokens: keep the first N tokens of the prompt, as the paper does with PG-19 (None: all).
        context_length: the model's context; ``max_prompt_tokens`` may not exceed it.

    Returns:
        list of int token ids.

    Raises:
        ValueError: ``max_prompt_tokens`` < 1 or above the model's context; ``system`` without ``chat``;
            ``chat`` with a tokenizer that has no chat template; an empty prompt.
    """
    if max_prompt_tokens is not None:
        if not isinstance(max_prompt_tokens, int) or isinstance(max_prompt_tokens, bool) or max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be an integer >= 1, got {max_prompt_tokens!r}")
        if context_length is not None and max_prompt_tokens > context_length:
            raise ValueError(f"max_prompt_tokens={max_prompt_tokens} exceeds the model's context of {context_length} tokens")
    if system is not None and not chat:
        raise ValueError("system is only used with chat=True (--chat)")
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("this tokenizer has no chat template; drop --chat")
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        ids = list(ids)
    else:
        ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])
    if max_prompt_tokens is not None:
        ids = ids[:max_prompt_tokens]
    if not ids:
        raise ValueError("prompt is empty: give some text (--prompt or --prompt-file)")
    return [int(i) for i in ids]
