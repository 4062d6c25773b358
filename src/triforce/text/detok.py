"""Incremental detokenization: the text of a growing token sequence, in work linear in its length.

Decoding the whole output again after every token costs O(n) per token, O(n^2) per request. Like vLLM
(``detokenize_incrementally``, vllm/transformers_utils/detokenizer_utils.py) and mlx-lm's streaming detokenizers,
:class:`IncrementalDetokenizer` decodes only a short window of recent tokens. It keeps two offsets into the tokens:

* ``read_offset``: the text of ``tokens[:read_offset]`` has been given out;
* ``prefix_offset`` <= ``read_offset``: the tokens ``tokens[prefix_offset:read_offset]`` are decoded again as context,
  because a token's text can depend on the tokens before it (SentencePiece drops the leading space of the first
  token of a decode; byte-level BPE needs the earlier bytes of a character).

For a new token it decodes ``prefix = tokens[prefix_offset:read_offset]`` (cached) and
``new = tokens[prefix_offset:]``, gives out ``new[len(prefix):]`` and moves both offsets forward, unless ``new``
ends with U+FFFD (the replacement character: an incomplete UTF-8 character, whose remaining bytes come with the next
tokens) or brings no new text (a skipped special token): then it gives out nothing and waits.

Work per token: at most three decodes of at most ``2 * MAX_HELD + 2`` tokens each (the window
``tokens[prefix_offset:]``, and the new prefix after an emission), whatever the output's length. Tokens are held only
while a character is incomplete (a UTF-8 character has at most 4 bytes, so spans at most 4 tokens) or no new text came;
past :attr:`IncrementalDetokenizer.MAX_HELD` held tokens (a run of invalid bytes or of skipped special tokens) the text
is given out up to the last 3 tokens, which is where an incomplete character can still start.

Exactness: the concatenated output equals ``tokenizer.decode(tokens)`` whenever decoding splits at the emission points,
which holds for byte-level BPE (GPT-2, Llama 3, SmolLM2, Qwen2: UTF-8 decoding restarts after a complete character)
and for character and SentencePiece tokenizers without cleanup of tokenization spaces; the forced emission after
:attr:`~IncrementalDetokenizer.MAX_HELD` held tokens can differ from the full decode only inside a run of invalid bytes
(tests/test_detok.py checks random sequences with byte tokens against the SmolLM2 tokenizer).
"""

from __future__ import annotations


class IncrementalDetokenizer:
    """The text of a token sequence that grows one token at a time.

    Args:
        tokenizer: a Hugging Face tokenizer (``decode(ids, skip_special_tokens=...)`` is all it needs).
        skip_special_tokens: passed to every ``decode``.

    Attributes:
        tokens: every token id added so far.
        decode_calls: ``tokenizer.decode`` calls so far; ``decoded_tokens``: tokens they decoded in total (both measure
            the work, which is linear in ``len(tokens)``).
    """

    MAX_HELD = 8  # tokens held back (waiting for more of a character) before text is given out anyway
    KEEP = 3  # tokens still held then: an incomplete character (<= 4 bytes, >= 1 byte per token) starts in them

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.tokens: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.prefix_text = ""  # decode(tokens[prefix_offset:read_offset])
        self.decode_calls = 0
        self.decoded_tokens = 0

    def _decode(self, start: int, end: int) -> str:
        self.decode_calls += 1
        self.decoded_tokens += end - start
        return self.tokenizer.decode(self.tokens[start:end], skip_special_tokens=self.skip_special_tokens)

    def _advance(self, new_text: str, end: int) -> str:
        """Give out ``new_text`` (the decode of ``tokens[prefix_offset:end]``) past the prefix;
        ``read_offset = end``."""
        delta = new_text[len(self.prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, end
        self.prefix_text = self._decode(self.prefix_offset, self.read_offset)
        return delta

    def add(self, token_id: int) -> str:
        """Append ``token_id``; returns the text it completes ("" while a character is incomplete)."""
        self.tokens.append(token_id)
        n = len(self.tokens)
        new_text = self._decode(self.prefix_offset, n)
        if len(new_text) > len(self.prefix_text) and not new_text.endswith("\ufffd"):
            return self._advance(new_text, n)
        if n - self.read_offset > self.MAX_HELD:
            end = n - self.KEEP
            return self._advance(self._decode(self.prefix_offset, end), end)
        return ""

    def flush(self) -> str:
        """The text held back at the end (an incomplete character, rendered as U+FFFD); then nothing is held."""
        n = len(self.tokens)
        if n == self.read_offset:
            return ""
        return self._advance(self._decode(self.prefix_offset, n), n)
