"""Turning user text into prompt token ids: Project Gutenberg stripping, documents with a question, chat templates,
truncation."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ..errors import ParameterError

# Project Gutenberg's markers. Files since about 2000: "*** START OF THE/THIS PROJECT GUTENBERG EBOOK ... ***" and
# "*** END OF ...". Files from the 1990s (a good share of PG-19) have neither: their licence header ends with a line
# like "*END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.29.93*END*" and the text with a line like
# "End of this Project Gutenberg Etext of ...", which newer files also carry just before their "*** END OF" line.
_START = re.compile(r"^\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG.*$", re.MULTILINE | re.IGNORECASE)
_END = re.compile(r"^\*\*\* ?END OF (THE|THIS) PROJECT GUTENBERG.*$", re.MULTILINE | re.IGNORECASE)
_OLD_START = re.compile(r"^\*+ ?END\b.*THE SMALL PRINT.*$", re.MULTILINE | re.IGNORECASE)
_OLD_END = re.compile(r"^[ \t]*End of (the |this )?Project Gutenberg\b.*$", re.MULTILINE | re.IGNORECASE)


def normalize_newlines(text: str) -> str:
    """``\\r\\n`` and lone ``\\r`` line endings (Project Gutenberg ships ``\\r\\n``) -> ``\\n``."""
    return text.replace("\r\n", "\n").replace("\r", "\n")


def strip_gutenberg(text: str) -> str:
    """Remove a Project Gutenberg licence header and footer, old (1990s) and new formats.

    Header: everything up to the ``*** START OF THE PROJECT GUTENBERG ...`` line, or, in files without one, up to
    the ``*END*THE SMALL PRINT! ...*END*`` line that ends the old licence. Footer: everything from the first
    ``End of (the|this) Project Gutenberg ...`` or ``*** END OF THE PROJECT GUTENBERG ...`` line after the header.
    Line endings become ``\\n`` whatever the markers (:func:`normalize_newlines`).

    Args:
        text: the file's text.

    Returns:
        the book's text, without surrounding blank lines when a marker was found; otherwise ``text`` with its line
        endings normalized.
    """
    text = normalize_newlines(text)
    start = _START.search(text) or _OLD_START.search(text)
    if start:
        text = text[start.end():]
    ends = [m.start() for m in (_END.search(text), _OLD_END.search(text)) if m]
    if ends:
        text = text[:min(ends)]
    return text.strip("\n") if (start or ends) else text


def document_prompt(document: str, question: str) -> str:
    """The text of a question about a document: the document first (so that a follow-up question about the same
    document reuses its KV cache), a blank line, then the question."""
    return f"{document.rstrip()}\n\n{question.strip()}"


def _encode(tokenizer: Any, text: str, chat: bool, system: str | None) -> list[int]:
    if chat:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    return [int(i) for i in tokenizer(text, add_special_tokens=True)["input_ids"]]


@dataclass
class PromptCut:
    """What ``max_prompt_tokens`` dropped from a prompt (reported on stderr, in the stats line and in ``--json``).

    Attributes:
        kept_tokens: tokens of the prompt as given to the model.
        dropped_tokens: tokens cut away (of the document, with a question about it; else of the prompt's end).
        kept: which part stayed: ``"first tokens"`` or ``"the document's first tokens and the question"``.
    """

    kept_tokens: int
    dropped_tokens: int
    kept: str

    def summary(self) -> str:
        """One line for stderr."""
        total = self.kept_tokens + self.dropped_tokens
        return (f"the prompt was cut to {self.kept_tokens} of {total} tokens (--max-prompt-tokens): kept "
                f"{self.kept}, dropped {self.dropped_tokens} ({100 * self.dropped_tokens / total:.1f}%)")


def encode_prompt(tokenizer: Any, text: str, chat: bool = False, system: str | None = None,
                  max_prompt_tokens: int | None = None, context_length: int | None = None,
                  document: str | None = None) -> list[int]:
    """Token ids of a prompt: :func:`encode_prompt_cut`'s ids (same arguments and errors)."""
    return encode_prompt_cut(tokenizer, text, chat, system, max_prompt_tokens, context_length, document)[0]


def encode_prompt_cut(tokenizer: Any, text: str, chat: bool = False, system: str | None = None,
                      max_prompt_tokens: int | None = None, context_length: int | None = None,
                      document: str | None = None) -> tuple[list[int], PromptCut | None]:
    """Token ids of a prompt, and what ``max_prompt_tokens`` cut from it.

    Args:
        tokenizer: a transformers tokenizer.
        text: the prompt text (the user message when ``chat``); with ``document``, the question about it.
        chat: wrap the text in the tokenizer's chat template (with a generation prompt).
        system: system message for the chat template (only with ``chat``).
        max_prompt_tokens: keep the first N tokens of the prompt, as the paper does with PG-19 (None: all). With
            ``document``, the document is cut instead, so that the question and the chat template's closing tokens
            stay and the whole prompt has at most N tokens.
        context_length: the model's context; ``max_prompt_tokens`` may not exceed it.
        document: a document the question ``text`` is about; the prompt is :func:`document_prompt`
            (document, blank line, question), inside one user message with ``chat``.

    Returns:
        ``(ids, cut)``: a list of int token ids, and a :class:`PromptCut` where tokens were dropped (else None).

    Raises:
        ValueError: ``max_prompt_tokens`` < 1 or above the model's context; ``system`` without ``chat``;
            ``chat`` with a tokenizer that has no chat template; an empty prompt; a question (with the template)
            that leaves no room for the document within ``max_prompt_tokens``.
    """
    if max_prompt_tokens is not None:
        if not isinstance(max_prompt_tokens, int) or isinstance(max_prompt_tokens, bool) or max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be an integer >= 1, got {max_prompt_tokens!r}")
        if context_length is not None and max_prompt_tokens > context_length:
            raise ValueError(f"max_prompt_tokens={max_prompt_tokens} exceeds the model's context of {context_length} "
                             "tokens")
    if system is not None and not chat:
        raise ParameterError("`system` is only used with `chat`")
    if chat and not getattr(tokenizer, "chat_template", None):
        raise ParameterError("this tokenizer has no chat template: `chat` cannot be used")
    cut = None
    if document is None:
        ids = _encode(tokenizer, text, chat, system)
        if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
            cut = PromptCut(max_prompt_tokens, len(ids) - max_prompt_tokens, "the first tokens")
            ids = ids[:max_prompt_tokens]
    else:
        ids = _encode(tokenizer, document_prompt(document, text), chat, system)
        if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
            overhead = len(_encode(tokenizer, document_prompt("", text), chat, system))
            if overhead >= max_prompt_tokens:
                raise ValueError(f"max_prompt_tokens={max_prompt_tokens} leaves no room for the document: the question "
                                 f"{'and the chat template take' if chat else 'takes'} {overhead} tokens")
            doc_ids = tokenizer(document, add_special_tokens=False)["input_ids"]
            keep = max_prompt_tokens - overhead
            for _ in range(8):  # re-tokenizing at the cut can merge differently: shrink until it fits
                ids = _encode(tokenizer, document_prompt(tokenizer.decode(doc_ids[:keep]), text), chat, system)
                if len(ids) <= max_prompt_tokens or keep == 0:
                    break
                keep = max(0, keep - (len(ids) - max_prompt_tokens))
            ids = ids[:max_prompt_tokens] if len(ids) > max_prompt_tokens else ids
            cut = PromptCut(len(ids), max(0, len(doc_ids) - keep), "the document's first tokens and the question")
    if not ids:
        raise ParameterError("`prompt` is empty: give some text")
    return ids, cut
