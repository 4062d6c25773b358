"""Structured output: every tier's distribution masked to the tokens a grammar allows (constrained decoding).

A grammar (a JSON schema, any JSON object, a regular expression or a Lark grammar) defines, at each prefix of the
output, the set A(prefix) of tokens that keep the output inside its language. Constrained decoding samples from
the target's distribution restricted to A and renormalised,

    p'(x | prefix) = p(x | prefix) [x in A(prefix)] / sum_{y in A(prefix)} p(y | prefix),

by setting the logits of the other tokens to -inf before temperature, top-k and top-p (as vLLM, SGLang and
llama.cpp apply their grammars' masks). Every model tier masks its logits with the same rule at the same prefix
(``ModelTier.step``), so each verification runs speculative decoding's rule (Leviathan et al. 2023, Sec. 2.3) on
the masked q' and p': the output is distributed exactly as p' at every step, the constrained target distribution,
and under greedy decoding it is the argmax over A, token for token what constrained plain decoding gives. A draft
outside A (an n-gram drafter's may be) has p'(x) = 0 and is always rejected; the rows after it are never read.

The grammars are compiled and matched by llguidance (MIT; the matcher llama.cpp, vLLM and SGLang use): one
:class:`GrammarConstraint` per generation, its matcher moved (consume / rollback) to each prefix a tier asks about,
masks kept by prefix.
"""

from __future__ import annotations

import functools
import json
import threading
from typing import Any, Protocol, Sequence

import torch

from ..text.tokens import common_prefix_length

#: ``response_format`` types (OpenAI's ``json_object`` and ``json_schema``; ``regex`` and ``lark`` as extensions)
RESPONSE_FORMATS = ("text", "json_object", "json_schema", "regex", "lark")
#: masks kept per generation, by prefix (a verification asks for gamma + 1 prefixes; the tiers below for theirs)
MASK_CACHE_ENTRIES = 256
#: largest grammar accepted, in bytes of llguidance's serialized grammar (a JSON schema, a pattern, a Lark text)
MAX_GRAMMAR_BYTES = 256 * 1024
#: whitespace a JSON schema allows between tokens unless its ``x-guidance`` says otherwise: a space, or one or two
#: newlines and up to 20 spaces or tabs of indentation (llama.cpp's ``json-schema-to-grammar`` rule); unbounded
#: whitespace let a small model spend its tokens on indentation (docs/structured_output.md)
JSON_WHITESPACE = r"( |\n{1,2}[ \t]{0,20})?"
#: stack of the thread llguidance compiles a grammar on: its compiler recurses along chains of references
#: (``$ref`` to ``$ref``, rule to rule), and a chain of 1,000 overflowed the 8 MiB main-thread stack (a crash, not
#: an error); 256 MiB of address space (pages are only touched as used) holds the longest chain that fits in
#: MAX_GRAMMAR_BYTES
COMPILE_STACK_BYTES = 256 * 1024 * 1024


class GrammarError(ValueError):
    """The grammar's matcher failed during generation (llguidance's limits, or a grammar with no way to go on)."""


class TokenConstraint(Protocol):
    """What a tier needs from a constraint: the allowed tokens after any prefix of the output."""

    def begin(self, prompt_tokens: int) -> None:
        """A generation starts after a prompt of this many tokens (what precedes the output in every sequence)."""

    def mask_logits(self, logits: torch.Tensor, seq: Sequence[int], drafts: Sequence[int]) -> torch.Tensor:
        """``logits`` (R, V) of the R positions after ``seq + drafts[:j]`` (j = 0..R-1), with disallowed tokens
        at -inf (a new tensor)."""


class GrammarConstraint:
    """A grammar's token masks for one generation (module docstring), through an llguidance matcher.

    Args:
        tokenizer: the model's Hugging Face tokenizer (a fast one: llguidance reads its vocabulary).
        grammar: an llguidance grammar (:func:`grammar_from_response_format`).
        vocab_size: the width V of the model's logits (token ids past the tokenizer's are never allowed).
        eos_ids: the tokens that end generation; allowed where the grammar's language may end.

    Raises:
        ImportError: llguidance is not installed (``pip install 'triforce[grammar]'``).
        ValueError: the grammar does not compile (llguidance's message).
    """

    def __init__(self, tokenizer, grammar: str, vocab_size: int, eos_ids: Sequence[int]) -> None:
        import llguidance
        import llguidance.torch

        self._ll = llguidance.torch
        ll_tokenizer = _ll_tokenizer(tokenizer, vocab_size, tuple(eos_ids))
        self.matcher = _on_big_stack(llguidance.LLMatcher, ll_tokenizer, grammar)
        if self.matcher.is_error():  # the grammar does not compile: llguidance's message names where
            raise ValueError(_one_line(self.matcher.get_error()))
        self.vocab_size = vocab_size
        self.eos_ids = frozenset(eos_ids) | frozenset(ll_tokenizer.eos_tokens)  # the ends the matcher knows
        self._bitmask = llguidance.torch.allocate_token_bitmask(1, ll_tokenizer.vocab_size)
        self._shifts = torch.arange(32, dtype=torch.int32)
        self._consumed: list[int] = []  # the output tokens the matcher has consumed
        self._masks: dict[tuple[int, ...], torch.Tensor] = {}
        self.start = 0

    def begin(self, prompt_tokens: int) -> None:
        """Start a generation after ``prompt_tokens`` prompt tokens: the matcher at the grammar's start."""
        self.matcher.reset()
        self._consumed, self._masks, self.start = [], {}, prompt_tokens

    def _goto(self, output: list[int]) -> bool:
        """Move the matcher to ``output`` (roll back to the common prefix, consume the rest); False where a token
        of ``output`` leaves the language (the matcher then stands on the longest allowed prefix)."""
        common = common_prefix_length(self._consumed, output)
        if common < len(self._consumed):
            self.matcher.rollback(len(self._consumed) - common)
            del self._consumed[common:]
        rest = output[common:]
        if not rest:
            return True
        n = self.matcher.validate_tokens(rest)  # how many of them the grammar accepts, consuming none
        if n:
            self.matcher.consume_tokens(rest[:n])
            self._consumed += rest[:n]
            self._check(len(self._consumed))
        return n == len(rest)

    def _check(self, tokens: int) -> None:
        """Raise :class:`GrammarError` where the matcher has failed (llguidance then allows only EOS, which would
        end the output as if the grammar were complete)."""
        if self.matcher.is_error():
            reason = (self.matcher.get_error().strip().splitlines() or ["unknown"])[0]
            if reason == "NoExtensionBias":
                reason = "no token can continue the output (a grammar whose language is empty, or a dead end)"
            raise GrammarError(f"response_format: the grammar's matcher failed after {tokens} generated tokens: "
                               f"{reason[:300]}")

    def allowed(self, output: list[int]) -> torch.Tensor | None:
        """(V,) bool: the tokens allowed after ``output`` (the generated tokens so far); None where ``output``
        itself leaves the language."""
        key = tuple(output)
        mask = self._masks.get(key)
        if mask is None:
            if not self._goto(list(output)):
                return None
            self._ll.fill_next_token_bitmask(self.matcher, self._bitmask, 0)
            self._check(len(output))
            bits = (self._bitmask[0, :, None] >> self._shifts) & 1  # (V / 32, 32): bit i of word w is token 32w + i
            mask = bits.flatten()[:self.vocab_size].bool()
            if len(self._masks) >= MASK_CACHE_ENTRIES:
                self._masks.clear()
            self._masks[key] = mask
        return mask

    def mask_logits(self, logits: torch.Tensor, seq: Sequence[int], drafts: Sequence[int]) -> torch.Tensor:
        """``logits`` (R, V) of the positions after ``seq + drafts[:j]``, j = 0..R-1, with the tokens the grammar
        does not allow there at -inf. A row whose prefix left the language (past a draft the grammar rejects, or
        past an EOS, which a drafter may propose beyond) is left as it is: the verifier never emits such a prefix
        (it rejects that draft: p' = 0; it stops at an EOS), so the row's distribution is never part of the output.
        """
        output = list(seq[self.start:])
        masks = []
        for j in range(logits.shape[0]):
            masks.append(self.allowed(output + list(drafts[:j])) if j == 0 or masks[-1] is not None else None)
        if masks[0] is None and not self.eos_ids.intersection(output):  # the output itself left the language
            # (not by proposing past an EOS): never go on unconstrained, say so
            raise GrammarError(f"response_format: the grammar's matcher rejects the output after {len(output)} "
                               "tokens although its mask allowed them (a token llguidance reads two ways)")
        if all(m is None for m in masks):
            return logits
        everything = torch.ones(logits.shape[-1], dtype=torch.bool)
        allowed = torch.stack([everything if m is None else m for m in masks]).to(logits.device)
        return logits.masked_fill(~allowed, float("-inf"))


def _one_line(message: str) -> str:
    return " ".join(line.strip() for line in message.splitlines() if line.strip())


def _on_big_stack(fn, *args):
    """``fn(*args)`` on a thread with a :data:`COMPILE_STACK_BYTES` stack (llguidance's compiler recursion)."""
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
            out["error"] = e

    with _STACK_LOCK:  # threading.stack_size is process-wide: set it only around this thread's start
        previous = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            thread = threading.Thread(target=run, name="triforce-grammar")
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


_STACK_LOCK = threading.Lock()


def reads_as_special(tokenizer, text: str, vocab_size: int, eos_ids: Sequence[int]) -> bool:
    """Whether llguidance reads ``text`` as one special token of ``tokenizer`` (an added token such as Qwen2.5's
    ``<tool_call>``): a grammar must then name it (``<tool_call>`` unquoted in Lark), since the quoted text is
    written in other tokens. ``vocab_size`` and ``eos_ids`` as for :class:`GrammarConstraint`.

    Raises:
        ImportError: llguidance is not installed.
    """
    ids = tokenizer.convert_tokens_to_ids([text])
    if not ids or ids[0] is None or ids[0] == tokenizer.unk_token_id or ids[0] >= vocab_size:
        return False
    return bool(_ll_tokenizer(tokenizer, vocab_size, tuple(eos_ids)).is_special_token(ids[0]))


@functools.lru_cache(maxsize=4)
def _ll_tokenizer(tokenizer, vocab_size: int, eos_ids: tuple[int, ...]):
    """llguidance's view of a Hugging Face tokenizer (built once per tokenizer: it scans the vocabulary)."""
    import llguidance.hf

    try:
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos_ids) or None)
    except Exception:  # noqa: BLE001 - a decoder llguidance does not know (e.g. a character-level one): each
        pass  # token's bytes as the tokenizer decodes it alone
    try:
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_TokenBytes(tokenizer, vocab_size, eos_ids)),
                                      n_vocab=vocab_size, eos_token=list(eos_ids) or None)
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"structured output needs a tokenizer llguidance can read: {e}") from e


class _TokenBytes:
    """A tokenizer as llguidance's ``TokenizerWrapper`` takes one: every token's bytes (the text the Hugging Face
    tokenizer decodes it to alone; a special token is 0xFF and its name, llguidance's convention) and an encoder."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: tuple[int, ...]) -> None:
        special = set(tokenizer.all_special_ids)
        names = tokenizer.convert_ids_to_tokens(list(range(min(len(tokenizer), vocab_size))))
        self.tokens = [b"\xff" + (n or f"<{i}>").encode() if i in special else tokenizer.decode([i]).encode()
                       for i, n in enumerate(names)] + [b"\xff<pad>"] * max(0, vocab_size - len(names))
        self.eos_token_id = eos_ids[0] if eos_ids else tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = sorted(special)
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer(text, add_special_tokens=False)["input_ids"]


def grammar_from_response_format(response_format: Any, param: str = "response_format") -> str | None:
    """The llguidance grammar of an OpenAI ``response_format``, or None for ``{"type": "text"}`` / None.

    Args:
        response_format: ``{"type": "json_object"}`` (any JSON object), ``{"type": "json_schema", "json_schema":
            {"schema": {...}, "name": ..., "strict": ...}}`` (OpenAI's),
            ``{"type": "regex", "regex": "..."}`` or ``{"type": "lark", "lark": "..."}`` (extensions, as vLLM's
            guided decoding offers).
        param: the name errors give the value.

    Raises:
        ImportError: llguidance is not installed.
        ValueError: naming ``param``: not an object, an unknown type, a missing or malformed field, a grammar over
            :data:`MAX_GRAMMAR_BYTES` or one that does not compile (llguidance's message).
    """
    if response_format is None:
        return None
    if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
        raise ValueError(f"{param} must be an object with a type, one of {', '.join(RESPONSE_FORMATS)}; got "
                         f"{json.dumps(response_format, default=str)[:80]}")
    kind = response_format["type"]
    if kind not in RESPONSE_FORMATS:
        raise ValueError(f"{param}.type must be one of {', '.join(RESPONSE_FORMATS)}, got {kind!r}")
    from llguidance import LLMatcher

    if kind == "text":
        return None
    if kind == "json_object":
        grammar = LLMatcher.grammar_from_json_schema(json.dumps(_bounded_whitespace({"type": "object"})))
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise ValueError(f"{param}.json_schema must be an object holding the schema (\"schema\": {{...}})")
        schema = spec.get("schema")
        if not isinstance(schema, dict):
            raise ValueError(f"{param}.json_schema.schema must be a JSON schema object, got "
                             f"{type(schema).__name__ if 'schema' in spec else 'none'}")
        try:
            grammar = LLMatcher.grammar_from_json_schema(json.dumps(_bounded_whitespace(schema)))
        except (TypeError, ValueError) as e:  # values JSON cannot hold (a set, NaN...)
            raise ValueError(f"{param}.json_schema.schema is not JSON: {e}") from e
    else:
        text = response_format.get(kind)
        if not isinstance(text, str) or not text:
            raise ValueError(f"{param}.{kind} must be a non-empty string")
        grammar = LLMatcher.grammar_from_regex(text) if kind == "regex" else LLMatcher.grammar_from_lark(text)
    if len(grammar) > MAX_GRAMMAR_BYTES:
        raise ValueError(f"{param}: the grammar is {len(grammar)} bytes; at most {MAX_GRAMMAR_BYTES} are accepted")
    error = _on_big_stack(LLMatcher.validate_grammar, grammar)
    if error:
        raise ValueError(f"{param}: {_one_line(error)}")
    return grammar


def _bounded_whitespace(schema: dict) -> dict:
    """``schema`` with :data:`JSON_WHITESPACE` as llguidance's whitespace rule, unless it sets ``x-guidance``."""
    return schema if "x-guidance" in schema else {**schema, "x-guidance": {"whitespace_pattern": JSON_WHITESPACE}}


def constraint_for(response_format: Any, tokenizer, vocab_size: int, eos_ids: Sequence[int],
                   param: str = "response_format") -> GrammarConstraint | None:
    """A fresh :class:`GrammarConstraint` for one generation under ``response_format``; None for text.

    Raises:
        ImportError, ValueError: see :func:`grammar_from_response_format`; a grammar llguidance rejects (its
            message, naming ``param``).
    """
    grammar = grammar_from_response_format(response_format, param)
    if grammar is None:
        return None
    try:
        return GrammarConstraint(tokenizer, grammar, vocab_size, eos_ids)
    except ValueError as e:
        raise ValueError(f"{param}: {e}") from e
