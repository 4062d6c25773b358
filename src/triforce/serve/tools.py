"""``triforce serve``: tool calls (OpenAI's ``tools`` and ``tool_choice``) for models whose chat template defines
them in the Hermes format (Qwen2.5, Qwen3, Hermes 2/3): the tools go into the prompt through the template, and the
model's ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks come back as ``tool_calls``.

``tool_choice`` ``auto`` leaves the choice to the model and parses what it writes; ``required`` and a named function
constrain the output to tool calls with a grammar (``speculation/grammar.py``: every tier's distribution is masked, so
the output is exactly the model's distribution restricted to well-formed calls whose arguments match the tool's JSON
schema); ``none`` leaves the tools out of the prompt. Sources: OpenAI's chat completions API (``tools``,
``tool_choice``, ``tool_calls``, the streamed ``delta.tool_calls``); the Hermes format as vLLM's ``hermes`` tool parser
and llama.cpp's server read it.
"""

from __future__ import annotations

import importlib.util
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Sequence

from .settings import _invalid

#: the most tools one request may declare (OpenAI's limit)
MAX_TOOLS = 128
OPEN, CLOSE, FENCE = "<tool_call>", "</tool_call>", "```json"
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
#: how the Hermes templates render a call (``tojson``'s separators): the grammar of a forced call writes the same
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class ToolSpec:
    """A request's validated tools.

    Attributes:
        tools: OpenAI tool objects (``{"type": "function", "function": {"name", "description", "parameters"}}``),
            as given to the chat template.
        choice: ``auto`` (the model decides), ``required`` (at least one call) or ``function`` (a call of
            ``function_name``).
        function_name: the function a named ``tool_choice`` forces, else None.
        parallel: more than one call allowed (``parallel_tool_calls``, default true).
    """

    tools: tuple[dict, ...]
    choice: str
    function_name: str | None
    parallel: bool

    @property
    def names(self) -> tuple[str, ...]:
        """The offered functions' names."""
        return tuple(tool["function"]["name"] for tool in self.tools)

    def response_format(self, tags_are_tokens: bool = False) -> dict | None:
        """The grammar of a forced choice as a ``response_format`` (``{"type": "lark", ...}``): one call, or
        ``parallel`` calls separated by newlines (and one more newline allowed before the end), each
        ``<tool_call>\\n{"name": F, "arguments": A}\\n</tool_call>`` with A matching F's ``parameters`` schema; None for
        ``auto`` (the model may answer in text). Where the tags are tokens of their own (Qwen2.5's added tokens, which
        llguidance reads as special), the grammar names those tokens, as the model writes them (``tags_are_tokens``:
        :func:`~triforce.speculation.grammar.reads_as_special` of both tags)."""
        if self.choice == "auto":
            return None
        bodies = []
        for tool in self.tools:
            fn = tool["function"]
            if self.function_name not in (None, fn["name"]):
                continue
            schema = {"type": "object", "properties": {"name": {"const": fn["name"]},
                                                       "arguments": fn.get("parameters") or {"type": "object"}},
                      "required": ["name", "arguments"], "additionalProperties": False, "x-guidance": _JSON_STYLE}
            bodies.append(f"%json {json.dumps(schema)}")
        calls = 'call ("\\n" call)* "\\n"?' if self.parallel else 'call "\\n"?'  # a newline may end the calls
        open_, close = (OPEN, CLOSE) if tags_are_tokens else (json.dumps(OPEN), json.dumps(CLOSE))
        lark = f'start: {calls}\ncall: {open_} "\\n" body "\\n" {close}\nbody: {" | ".join(bodies)}\n'
        return {"type": "lark", "lark": lark}


def parse_tools(body: dict, chat_template: str | None) -> ToolSpec | None:
    """Validate ``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat request.

    Args:
        body: the request's JSON object.
        chat_template: the tokenizer's chat template (Jinja source), or None.

    Returns:
        a :class:`ToolSpec`, or None where no tool is to be offered (no tools, or ``tool_choice`` ``none``).

    Raises:
        APIError: 400 naming ``tools`` (not an array of function tools, a bad name or ``parameters``, a template
            without Hermes tool calls), ``tool_choice`` (not ``none``/``auto``/``required``/a named tool, a name not
            among the tools, a forced choice beside ``response_format`` or without llguidance) or
            ``parallel_tool_calls`` (not a boolean).
    """
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise _invalid("parallel_tool_calls must be a boolean", param="parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise _invalid("tool_choice is only allowed when tools are given (the functions in tools)",
                           param="tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise _invalid(f"tools must be an array of at most {MAX_TOOLS} function tools", param="tools")
    names = [_check_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools)]
    if len(set(names)) != len(names):
        raise _invalid("tools must not name a function twice", param="tools")
    if "tools" not in (chat_template or "") or OPEN not in (chat_template or ""):
        raise _invalid("this model's chat template defines no tool calls in the Hermes format (<tool_call> blocks, as "
                       "Qwen2.5, Qwen3 and Hermes templates do); omit tools", param="tools",
                       code="unsupported_parameter")
    name = None
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if choice.get("type") == "function" and isinstance(fn, dict) else None
        if name not in names:
            raise _invalid(f"tool_choice must name one of the tools ({', '.join(names)}) as "
                           '{"type": "function", "function": {"name": ...}}', param="tool_choice")
        choice = "function"
    elif choice is None:
        choice = "auto"
    elif choice not in ("none", "auto", "required"):
        raise _invalid("tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": "
                       f"{{\"name\": ...}}}}, got {json.dumps(choice)[:60]}", param="tool_choice")
    if choice == "none":
        return None
    if choice != "auto":
        if body.get("response_format") not in (None, {"type": "text"}):
            raise _invalid(f"tool_choice {choice!r} constrains the output to tool calls; it cannot be combined with "
                           "response_format", param="tool_choice", code="unsupported_parameter")
        if importlib.util.find_spec("llguidance") is None:
            raise _invalid(f"tool_choice {choice!r} needs llguidance on the server: pip install 'triforce[grammar]'",
                           param="tool_choice", code="unsupported_parameter")
    return ToolSpec(tuple(tools), choice, name, parallel is not False)


def _check_tool(tool: Any, where: str) -> str:
    """A tool's function name, after checking its shape; raises a 400 naming ``where``."""
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
        raise _invalid(f'{where} must be {{"type": "function", "function": {{"name": ..., "parameters": ...}}}}',
                       param=where)
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise _invalid(f"{where}.function.name must be 1-64 letters, digits, underscores or dashes", param=where)
    if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
        raise _invalid(f"{where}.function.parameters must be a JSON schema object", param=where)
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise _invalid(f"{where}.function.description must be a string", param=where)
    return name


def assistant_tool_calls(value: Any, where: str) -> list[dict]:
    """An assistant message's ``tool_calls`` for the chat template: OpenAI's ``[{"id", "type": "function",
    "function": {"name", "arguments": "<JSON text>"}}]`` with the arguments decoded to an object (the templates
    render them with ``tojson``, as vLLM and llama.cpp pass them).

    Raises:
        APIError: 400 naming ``<where>.tool_calls``: not an array of function calls, arguments that are not JSON.
    """
    param = f"{where}.tool_calls"
    if not isinstance(value, list):
        raise _invalid(f"{param} must be an array of tool calls", param=param)
    out = []
    for j, call in enumerate(value):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
            raise _invalid(f'{param}[{j}] must be {{"id": ..., "type": "function", "function": {{"name": ..., '
                           '"arguments": "<JSON text>"}}', param=param)
        try:
            arguments = json.loads(fn["arguments"])
        except ValueError as e:
            raise _invalid(f"{param}[{j}].function.arguments is not JSON: {e}", param=param) from e
        out.append({"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": arguments}})
    return out


class ToolCallParser:
    """Splits a model's output into text content and Hermes tool calls, as it streams: :meth:`feed` takes each new
    piece of text and returns what can be sent now; :meth:`finish` the rest. The result does not depend on how the
    text is cut into pieces, so a streamed answer equals the non-streamed one (:meth:`parse`).

    Content is the text outside ``<tool_call>...</tool_call>`` blocks, less the whitespace that separates it from a
    block; a block whose inside is not ``{"name": str, "arguments": object}`` JSON stays in the content as written
    (vLLM's hermes parser does the same), and so does a block cut off by ``max_tokens``. A whole output that is one
    such object naming one of ``names``, bare or in a ```` ```json ```` fence, is a call too: Qwen2.5-Coder often
    leaves out the tags (llama.cpp's Hermes parser reads it the same way); an output that starts as one is held
    until it ends. Each call is ``{"id": "call_...", "type": "function", "function": {"name", "arguments": "<JSON
    text>"}}``.
    """

    def __init__(self, names: Sequence[str] = ()) -> None:
        self.buffer = ""  # text not yet sent: trailing whitespace, the start of a tag, or an open block
        self.calls = 0
        self.after_call = False  # whitespace after a block is dropped
        self.names = frozenset(names)
        self.bare = bool(self.names)  # the output may still be one call without tags: held until it ends

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """``(content to send, calls completed)`` after ``text`` is appended to the output."""
        self.buffer += text
        if self.bare:
            head = self.buffer.lstrip()
            if not head or head.startswith(("{", FENCE)) or FENCE.startswith(head):
                return "", []
            self.bare = False
        content, calls = [], []
        while self.buffer:
            if self.buffer.startswith(OPEN):
                end = self.buffer.find(CLOSE)
                if end < 0:
                    break  # an open block: wait for its end
                block = self.buffer[:end + len(CLOSE)]
                self.buffer = self.buffer[len(block):]
                call = self._call(block[len(OPEN):-len(CLOSE)])
                if call is None:
                    content.append(block)
                    self.after_call = False
                else:
                    calls.append(call)
                    self.after_call = True
                continue
            start = self.buffer.find(OPEN)
            text_part = self.buffer if start < 0 else self.buffer[:start]
            if self.after_call:
                stripped = text_part.lstrip()
                self.buffer = self.buffer[len(text_part) - len(stripped):]
                text_part = stripped
                if not text_part:
                    if start < 0:
                        break
                    continue
                self.after_call = False
            if start >= 0:  # text, then a block: the whitespace before the block is dropped
                content.append(text_part.rstrip())
                self.buffer = self.buffer[len(text_part):]  # the buffer starts with text_part
                continue
            keep = _held_back(text_part)  # trailing whitespace or a tag's start may still precede a block
            content.append(text_part[:len(text_part) - keep])
            self.buffer = text_part[len(text_part) - keep:]
            break
        return "".join(content), calls

    def finish(self) -> tuple[str, list[dict]]:
        """``(content, calls)`` still held back once the output has ended: whitespace, a lone tag start, a block
        cut off, or a whole output that is one call without tags."""
        calls = []
        if self.bare:
            self.bare = False
            inside = self.buffer.strip()
            if inside.startswith(FENCE) and inside.endswith("```"):
                inside = inside[len(FENCE):-3]
            call = self._call(inside, self.names)
            if call is not None:
                self.buffer = ""
                return "", [call]
            content, calls = self.feed("")
            rest, more = self.finish()
            return content + rest, calls + more
        rest, self.buffer = self.buffer, ""
        return ("" if self.after_call and not rest.strip() else rest), calls

    def _call(self, inside: str, names: frozenset | None = None) -> dict | None:
        try:
            value = json.loads(inside)
        except ValueError:
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) or \
                not isinstance(value.get("arguments", {}), dict) or (names is not None and value["name"] not in names):
            return None
        self.calls += 1
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": value["name"], "arguments": json.dumps(value.get("arguments", {}),
                                                                          ensure_ascii=False)}}

    @classmethod
    def parse(cls, text: str, names: Sequence[str] = ()) -> tuple[str | None, list[dict]]:
        """``(content, calls)`` of a whole output; content None when it is empty and there are calls (OpenAI's
        ``message.content`` beside ``tool_calls``)."""
        parser = cls(names)
        content, calls = parser.feed(text)
        rest, more = parser.finish()
        content, calls = content + rest, calls + more
        return (None if calls and not content else content), calls


def _held_back(text: str) -> int:
    """How many characters at the end of ``text`` to hold: the start of ``<tool_call>`` and the whitespace before
    it, or trailing whitespace (a block may follow)."""
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-k:]):
            return k + len(text[:-k]) - len(text[:-k].rstrip())
    return len(text) - len(text.rstrip())
