"""``triforce serve``: validation of OpenAI request bodies (completions and chat completions) and tokenization."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..speculation.hierarchy import MAX_SEED
from .settings import MAX_BODY_BYTES, MAX_CHOICES, MAX_STOP_SEQUENCES, APIError, ServerDefaults, _invalid
from .tools import CLOSE, OPEN, ToolSpec, assistant_tool_calls, parse_tools

if TYPE_CHECKING:  # pragma: no cover
    from ..api import TriForce


# ---------------------------------------------------------------------------------------------------- parsing
@dataclass
class GenerationRequest:
    """A validated request, ready for the engine.

    Attributes:
        kind: ``chat`` or ``completion``.
        prompt_ids: prompt token ids.
        max_tokens: tokens to generate at most.
        temperature, top_p, top_k: sampling.
        seed: seed or None.
        stop: stop strings.
        stream: answer as server-sent events.
        include_usage: (streaming) send a final chunk with ``usage``.
        model: the model id echoed in the response.
        logprobs: None, or report each token's log-probability with this many alternatives (chat: ``logprobs`` true
            and ``top_logprobs``; completions: ``logprobs`` N); ``speculation/logprobs.py``.
        echo: (completions) the prompt comes back before the completion, with its tokens' log-probabilities when
            ``logprobs`` is given; ``max_tokens`` 0 is then allowed (score a text, generate nothing).
        prompt_text: the prompt as the client sent it (a string), or None (token ids): what ``echo`` returns.
        response_format: OpenAI's ``response_format`` (``json_object``, ``json_schema``; ``regex`` and ``lark`` as
            extensions), validated and compiled once here; None for text (``speculation/grammar.py``).
        n: choices to generate (1 to :data:`~triforce.serve.settings.MAX_CHOICES`): samples of the same prompt, which
            share its prefill and decode as a batch (``worker.py``).
        tools: (chat) the tools offered to the model, whose ``<tool_call>`` blocks the answer returns as
            ``tool_calls`` (``tools.py``); None without tools.
    """

    kind: str
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    model: str
    logprobs: int | None = None
    echo: bool = False
    prompt_text: str | None = None
    response_format: dict | None = None
    n: int = 1
    tools: ToolSpec | None = None


# accepted and used
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options",
           "logprobs", "n", "response_format"}
_CHAT_ONLY = {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls"}
_COMPLETION_ONLY = {"prompt", "echo"}
# accepted and ignored (no effect on the output)
_IGNORED = {"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key"}
# accepted only at their neutral value; anything else is refused by name
_NEUTRAL_COMMON = {
    "presence_penalty": lambda v: v is None or (_is_number(v) and v == 0),
    "frequency_penalty": lambda v: v is None or (_is_number(v) and v == 0),
    "logit_bias": lambda v: v is None or v == {},
}
_NEUTRAL_CHAT = {
    "echo": lambda v: v is None or v is False,  # a completions field some clients send to chat too
    "functions": lambda v: v is None or v == [],
    "function_call": lambda v: v is None or v == "none",
}
_NEUTRAL_COMPLETION = {
    "best_of": lambda v: v is None or (_is_int(v) and v == 1),
    "suffix": lambda v: v is None or v == "",
}
_ROLES = ("system", "developer", "user", "assistant", "tool")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _type_name(v: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null",
            int: "integer", float: "number"}.get(type(v), type(v).__name__)


def parse_json_body(raw: bytes) -> dict:
    """Decode a request body: strict UTF-8, JSON without NaN/Infinity, an object at the top.

    Raises:
        APIError: 413 over :data:`MAX_BODY_BYTES`; 400 not UTF-8, not JSON, not an object.
    """
    if len(raw) > MAX_BODY_BYTES:
        raise APIError(413, f"request body is {len(raw)} bytes; the limit is {MAX_BODY_BYTES}", code="body_too_large")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _invalid(f"request body is not valid UTF-8 (byte {e.start}): send JSON encoded as UTF-8") from e

    def no_constants(name: str):
        raise ValueError(f"{name} is not valid JSON")

    try:
        body = json.loads(text, parse_constant=no_constants)
    except (ValueError, RecursionError) as e:
        raise _invalid(f"request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise _invalid(f"request body must be a JSON object, got {_type_name(body)}")
    return body


def _check_unsupported(body: dict, kind: str) -> None:
    allowed = _COMMON | _IGNORED | (_CHAT_ONLY if kind == "chat" else _COMPLETION_ONLY)
    neutral = dict(_NEUTRAL_COMMON, **(_NEUTRAL_CHAT if kind == "chat" else _NEUTRAL_COMPLETION))
    for key, value in body.items():
        if key in allowed:
            continue
        if key in neutral:
            if not neutral[key](value):
                raise _invalid(f"{key}={json.dumps(value)[:80]} is not supported by this server (no best_of, "
                               f"penalties, logit bias or functions); omit {key!r} or give its default",
                               param=key, code="unsupported_parameter")
            continue
        hint = {"prompt": " (prompt belongs to /v1/completions)",
                "messages": " (messages belongs to /v1/chat/completions)"}.get(key, "")
        raise _invalid(f"Unrecognized request argument supplied: {key}{hint}", param=key, code="unsupported_parameter")


def _chat_messages(value: Any) -> list[dict]:
    """Validate OpenAI chat messages; returns ``[{"role", "content"}]`` for the chat template, with an assistant's
    ``tool_calls`` (arguments decoded) and a tool result's ``tool_call_id``."""
    if value is None:
        raise _invalid("messages is required: a non-empty array of {role, content} objects", param="messages")
    if not isinstance(value, list):
        raise _invalid(f"messages must be an array, got {_type_name(value)}", param="messages")
    if not value:
        raise _invalid("messages must contain at least one message", param="messages")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _invalid(f"{where} must be an object with role and content, got {_type_name(m)}", param=where)
        role = m.get("role")
        if not isinstance(role, str):
            raise _invalid(f"{where}.role must be a string, one of {', '.join(_ROLES)}", param=f"{where}.role")
        if role not in _ROLES:
            raise _invalid(f"{where}.role {role!r} is not supported; use one of {', '.join(_ROLES)} "
                           "(function messages are not supported)", param=f"{where}.role")
        extra = {}
        for key, v in m.items():
            if key in ("role", "content"):
                continue
            if key == "name" or (key == "tool_call_id" and role == "tool"):
                if not isinstance(v, str):
                    raise _invalid(f"{where}.{key} must be a string", param=f"{where}.{key}")
                extra[key] = v
                continue
            if key == "tool_calls" and role == "assistant" and v:
                extra[key] = assistant_tool_calls(v, where)
                continue
            if v is None or v == []:
                continue
            raise _invalid(f"{where}.{key} is not supported by this server", param=f"{where}.{key}",
                           code="unsupported_parameter")
        if "content" not in m and "tool_calls" not in extra:
            raise _invalid(f"{where}.content is required", param=f"{where}.content")
        content = m.get("content")
        if content is None and "tool_calls" in extra:
            content = ""
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise _invalid(f"{where}.content[{j}] must be a text part {{\"type\": \"text\", \"text\": ...}} "
                                   "(images, audio and files are not supported)", param=f"{where}.content[{j}]")
                parts.append(part["text"])
            content = "".join(parts)
        elif not isinstance(content, str):
            raise _invalid(f"{where}.content must be a string or an array of text parts, got {_type_name(content)}",
                           param=f"{where}.content")
        out.append({"role": "system" if role == "developer" else role, "content": content, **extra})
    return out


def _completion_prompt(value: Any, vocab_size: int) -> str | list[int]:
    """A completions ``prompt``: a string, an array of token ids, or a one-element array of either."""
    if value is None:
        raise _invalid("prompt is required: a string or an array of token ids", param="prompt")
    if isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
        if len(value) != 1:
            raise _invalid(f"prompt holds {len(value)} prompts; this server serves one prompt per request (batch 1)",
                           param="prompt", code="unsupported_parameter")
        value = value[0]
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        if not value:
            raise _invalid("prompt must not be empty", param="prompt")
        if not all(_is_int(t) for t in value):
            raise _invalid("prompt must be a string or an array of integer token ids", param="prompt")
        bad = [t for t in value if not 0 <= t < vocab_size]
        if bad:
            raise _invalid(f"prompt token ids must be in [0, {vocab_size}), got {bad[:5]}", param="prompt")
        return list(value)
    raise _invalid(f"prompt must be a string or an array of token ids, got {_type_name(value)}", param="prompt")


def _stop_strings(value: Any, default: tuple[str, ...]) -> tuple[str, ...]:
    if value is None:
        return default
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise _invalid("stop must be a string or an array of strings", param="stop")
    if len(value) > MAX_STOP_SEQUENCES:
        raise _invalid(f"stop holds {len(value)} strings; at most {MAX_STOP_SEQUENCES} are allowed", param="stop")
    if any(not s for s in value):
        raise _invalid("stop strings must not be empty", param="stop")
    return tuple(value)


def parse_request(body: dict, kind: str, tf: "TriForce", defaults: ServerDefaults) -> GenerationRequest:
    """Validate an OpenAI request body and tokenize its prompt.

    Args:
        body: the decoded JSON object.
        kind: ``chat`` (``/v1/chat/completions``) or ``completion`` (``/v1/completions``).
        tf: the model (tokenizer, context length, vocabulary).
        defaults: server defaults for omitted fields.

    Returns:
        a :class:`GenerationRequest`.

    Raises:
        APIError: 400 naming the parameter (wrong type, out of range, unsupported, prompt longer than the
            context, ``max_tokens`` past the context); 404 for an unknown model.
    """
    _check_unsupported(body, kind)
    model = body.get("model")
    if model is not None:
        if not isinstance(model, str):
            raise _invalid(f"model must be a string, got {_type_name(model)}", param="model")
        if model not in (defaults.model_id, *defaults.model_aliases):
            raise APIError(404, f"The model {model!r} does not exist; this server serves {defaults.model_id!r}",
                           param="model", code="model_not_found")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _invalid(f"stream must be a boolean, got {_type_name(stream)}", param="stream")
    stream = bool(stream)
    include_usage = False
    opts = body.get("stream_options")
    if opts is not None:
        if not stream:
            raise _invalid("stream_options is only allowed when stream is true", param="stream_options")
        if not isinstance(opts, dict):
            raise _invalid(f"stream_options must be an object, got {_type_name(opts)}", param="stream_options")
        for key, v in opts.items():
            if key != "include_usage":
                raise _invalid(f"stream_options.{key} is not supported", param=f"stream_options.{key}",
                               code="unsupported_parameter")
            if v is not None and not isinstance(v, bool):
                raise _invalid("stream_options.include_usage must be a boolean", param="stream_options.include_usage")
            include_usage = bool(v)

    def number(name: str, default: float) -> float:
        v = body.get(name)
        if v is None:
            return default
        if not _is_number(v):
            raise _invalid(f"{name} must be a finite number, got {_type_name(v)}", param=name)
        return float(v)

    temperature = number("temperature", defaults.temperature)
    if not 0 <= temperature <= 2:
        raise _invalid(f"temperature must be in [0, 2] (0 = greedy), got {temperature}", param="temperature")
    top_p = number("top_p", defaults.top_p)
    if not 0 < top_p <= 1:
        raise _invalid(f"top_p must be in (0, 1], got {top_p}", param="top_p")
    top_k = body.get("top_k")
    if top_k is None:
        top_k = defaults.top_k
    elif not _is_int(top_k) or top_k < 0:
        raise _invalid(f"top_k must be an integer >= 0 (0 = disabled), got {json.dumps(top_k)[:40]}", param="top_k")
    seed = body.get("seed")
    if seed is None:
        seed = defaults.seed
    elif not _is_int(seed) or not 0 <= seed <= MAX_SEED:
        raise _invalid(f"seed must be an integer in [0, 2**63 - 1], got {json.dumps(seed)[:40]}", param="seed")
    stop = _stop_strings(body.get("stop"), defaults.stop)

    max_name = "max_tokens"
    max_tokens = body.get("max_tokens")
    if kind == "chat" and body.get("max_completion_tokens") is not None:
        if max_tokens is not None:
            raise _invalid("give max_tokens or max_completion_tokens, not both", param="max_completion_tokens")
        max_name, max_tokens = "max_completion_tokens", body["max_completion_tokens"]
    logprobs, echo = _logprobs_options(body, kind)
    n = body.get("n")
    if n is None:
        n = 1
    elif not _is_int(n) or not 1 <= n <= MAX_CHOICES:
        raise _invalid(f"n must be an integer in [1, {MAX_CHOICES}] (choices to generate), got {json.dumps(n)[:40]}",
                       param="n")
    if n > 1 and echo:
        raise _invalid("echo with n > 1 is not supported: ask for the prompt's log-probabilities in a request of "
                       "its own", param="n", code="unsupported_parameter")
    if max_tokens is not None and (not _is_int(max_tokens) or max_tokens < (0 if echo else 1)):
        raise _invalid(f"{max_name} must be an integer >= {0 if echo else 1}"
                       f"{'' if echo else ' (0 only with echo on /v1/completions)'}, got {json.dumps(max_tokens)[:40]}",
                       param=max_name)

    cfg = tf.target.model.cfg
    response_format = _response_format(body.get("response_format"))

    # the prompt, tokenized
    context = cfg.max_position_embeddings
    if kind == "chat":
        prompt_param = "messages"
        messages = _chat_messages(body.get("messages"))
        template = getattr(tf.tokenizer, "chat_template", None)
        if not template:
            raise _invalid("this model's tokenizer has no chat template; use /v1/completions", param="messages")
        tools = parse_tools(body, template if isinstance(template, str) else json.dumps(template))
        if tools is not None and tools.choice != "auto":  # forced calls: a grammar (tools.py)
            from ..speculation.grammar import reads_as_special

            tags = all(reads_as_special(tf.tokenizer, t, cfg.vocab_size, tf.engine.eos_ids) for t in (OPEN, CLOSE))
            response_format = _response_format(tools.response_format(tags))
        try:
            ids = tf.tokenizer.apply_chat_template(messages, tools=list(tools.tools) if tools else None,
                                                   add_generation_prompt=True, tokenize=True)
        except Exception as e:  # jinja2 TemplateError (e.g. roles that must alternate) and the like
            raise _invalid(f"the chat template rejected the messages: {e}", param="messages") from e
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        ids = [int(t) for t in ids]
    else:
        tools = None
        prompt_param = "prompt"
        prompt = _completion_prompt(body.get("prompt"), cfg.vocab_size)
        prompt_text = prompt if isinstance(prompt, str) else None
        if isinstance(prompt, str):
            ids = [int(t) for t in tf.tokenizer(prompt, add_special_tokens=True)["input_ids"]]
        else:
            ids = prompt
    if not ids:
        raise _invalid(f"{prompt_param} {'are' if prompt_param == 'messages' else 'is'} empty after tokenization",
                       param=prompt_param)
    scoring = echo and max_tokens == 0  # scoring a text needs no room to generate
    if len(ids) >= context + scoring:
        raise _invalid(f"This model's maximum context length is {context} tokens; the {prompt_param} "
                       f"{'are' if prompt_param == 'messages' else 'is'} {len(ids)} tokens"
                       f"{'' if scoring else ', which leaves no room to generate'}", param=prompt_param,
                       code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = min(defaults.max_tokens, context - len(ids))
    elif len(ids) + max_tokens > context:
        raise _invalid(f"This model's maximum context length is {context} tokens. However, you requested "
                       f"{len(ids) + max_tokens} tokens ({len(ids)} in the {prompt_param}, {max_tokens} for the "
                       f"completion); reduce {max_name} to at most {context - len(ids)}", param=max_name,
                       code="context_length_exceeded")
    return GenerationRequest(kind=kind, prompt_ids=ids, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                             top_k=top_k, seed=seed, stop=stop, stream=stream, include_usage=include_usage,
                             model=defaults.model_id, logprobs=logprobs, echo=echo,
                             prompt_text=prompt_text if kind == "completion" else None, n=n,
                             response_format=response_format, tools=tools)


def _logprobs_options(body: dict, kind: str) -> tuple[int | None, bool]:
    """``(alternatives per token or None, echo)`` from OpenAI's fields: chat ``logprobs`` (boolean) and
    ``top_logprobs`` (0-20, needs ``logprobs`` true); completions ``logprobs`` (0-20) and ``echo`` (boolean).

    Raises:
        APIError: 400 naming the field.
    """
    from ..speculation.logprobs import MAX_TOP_LOGPROBS

    v = body.get("logprobs")
    if kind == "chat":
        if v is not None and not isinstance(v, bool):
            raise _invalid(f"logprobs must be a boolean, got {_type_name(v)}", param="logprobs")
        top = body.get("top_logprobs")
        if top is not None:
            if not _is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS:
                raise _invalid(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got "
                               f"{json.dumps(top)[:40]}", param="top_logprobs")
            if not v:
                raise _invalid("top_logprobs needs logprobs set to true", param="top_logprobs")
        return ((top or 0) if v else None), False
    if v is not None and (not _is_int(v) or not 0 <= v <= MAX_TOP_LOGPROBS):
        raise _invalid(f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}] (alternatives per token) or null, "
                       f"got {json.dumps(v)[:40]}", param="logprobs")
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise _invalid(f"echo must be a boolean, got {_type_name(echo)}", param="echo")
    return v, bool(echo)


def _response_format(value: Any) -> dict | None:
    """``response_format`` checked and its grammar compiled once
    (:func:`~triforce.speculation.grammar.grammar_from_response_format`, no tokenizer needed); the worker builds each
    choice's matcher from it. None for text.

    Raises:
        APIError: 400 naming ``response_format``: malformed, a grammar that does not compile, or llguidance missing.
    """
    from ..speculation.grammar import grammar_from_response_format

    try:
        grammar = grammar_from_response_format(value)
    except ImportError as e:
        raise _invalid("response_format needs llguidance on the server: pip install 'triforce[grammar]'",
                       param="response_format", code="unsupported_parameter") from e
    except ValueError as e:
        raise _invalid(str(e), param="response_format") from e
    return None if grammar is None else value
