"""``triforce serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one :class:`~triforce.api.TriForce`.

Endpoints: ``GET /health``, ``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (both streamed as server-sent events with ``"stream": true``), ``GET /metrics``
(Prometheus text format). Documentation: docs/server.md.

Design (batch 1): one engine, one worker thread. Requests are validated and tokenized on the event loop, then
queued; the worker runs them one at a time in arrival order, so concurrent clients never share state, and each
request may reuse the KV cache of the previous one (longest common token prefix, see
:class:`~triforce.engine.Engine`). Tokens travel from the worker to the request's coroutine through an asyncio
queue. Between tokens (and between prefill chunks) the worker checks whether the request was cancelled (client
disconnected) or ran past its deadline, and then closes the token generator, which stops the engine and leaves
its cache consistent for the next request.

FastAPI, uvicorn and prometheus_client (the ``serve`` extra) are imported only when a server is built, so the
rest of the command line works without them.
"""

# (no ``from __future__ import annotations``: FastAPI reads the endpoints' annotations, e.g. ``Request``, at runtime)
import argparse
import asyncio
import hmac
import json
import math
import os
import queue
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from fastapi import FastAPI

    from .api import TriForce
    from .engine import SpeculationConfig

DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"
MAX_BODY_BYTES = 16 * 1024 * 1024
MAX_STOP_SEQUENCES = 4
DISCONNECT_POLL_SECONDS = 0.25
API_KEY_ENV = "TRIFORCE_API_KEY"
OPEN_PATHS = ("/health",)  # answered without the API key (load balancers' liveness checks)
ENDPOINTS = ("/health", "/v1/models", "/v1/completions", "/v1/chat/completions", "/metrics")

from .engine import MAX_SEED  # noqa: E402  (one seed range for the engine, `generate` and `serve`)


# ---------------------------------------------------------------------------------------------------- errors
class APIError(Exception):
    """An error answered as OpenAI's error body ``{"error": {"message", "type", "param", "code"}}``.

    Args:
        status: HTTP status (400 invalid request, 404 unknown model, 413 body too large, 503 queue full,
            504 timed out while queued, 500 internal).
        message: human-readable explanation (names the parameter and what is allowed).
        param: the offending request field (``"max_tokens"``, ``"messages[1].content"``) or None.
        type: OpenAI's error type (``invalid_request_error``, ``server_error``...).
        code: a short machine-readable code or None.
        headers: extra response headers (``Retry-After`` for 503).
    """

    def __init__(self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers or {}

    def body(self) -> dict:
        """The JSON error body."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


# ---------------------------------------------------------------------------------------------------- settings
@dataclass
class ServerDefaults:
    """Server-wide settings and the defaults a request's omitted fields take.

    Attributes:
        model_id: the id ``/v1/models`` lists; requests naming another model get 404.
        model_aliases: other names accepted for the model (e.g. its full source path or hub id).
        max_tokens: tokens generated when a request gives no ``max_tokens`` (capped by the context left).
        temperature, top_p, top_k: sampling defaults (``--temperature``, ``--top-p``, ``--top-k``).
        seed: default seed (None: random per request, reported in the ``triforce`` field).
        stop: default stop strings (a request's ``stop`` replaces them).
        spec: speculation settings (None: the model's default mode).
        queue_size: most requests waiting for the engine (not counting the one running); more get 503.
        request_timeout: seconds from a request's arrival after which its generation ends.
        api_key: when set, every request except ``GET /health`` must carry ``Authorization: Bearer <api_key>``
            (what OpenAI clients send), else 401 in OpenAI's error format. Never printed (not in ``repr``).
    """

    model_id: str = DEFAULT_MODEL_ID
    model_aliases: tuple[str, ...] = ()
    max_tokens: int = 256
    temperature: float = 0.6
    top_p: float = 0.9
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    spec: "SpeculationConfig | None" = None
    queue_size: int = 16
    request_timeout: float = 600.0
    api_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.api_key is not None:
            check_api_key(self.api_key, "api_key")
        if not isinstance(self.queue_size, int) or self.queue_size < 1:
            raise ValueError(f"queue_size must be an integer >= 1, got {self.queue_size!r}")
        if not isinstance(self.request_timeout, (int, float)) or not self.request_timeout > 0:
            raise ValueError(f"request_timeout must be a number of seconds > 0, got {self.request_timeout!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        self.stop = tuple(self.stop)
        self.model_aliases = tuple(self.model_aliases)


def check_api_key(key: object, name: str = "--api-key") -> None:
    """Raise ValueError (naming ``name``, never echoing the key) unless ``key`` can be sent in an HTTP header:
    a non-empty string of printable ASCII without spaces."""
    if not isinstance(key, str) or not key or not all(33 <= ord(c) <= 126 for c in key):
        raise ValueError(f"{name} must be a non-empty string of printable ASCII characters without spaces")


def model_id_for(source: str | None) -> str:
    """The model id served for a model source: the basename of its path or hub id (default model:
    ``SmolLM2-135M-Instruct``)."""
    if not source:
        return DEFAULT_MODEL_ID
    name = os.path.basename(os.path.normpath(str(source)))
    return name or DEFAULT_MODEL_ID


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


# accepted and used
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options"}
_CHAT_ONLY = {"messages", "max_completion_tokens"}
_COMPLETION_ONLY = {"prompt"}
# accepted and ignored (no effect on the output)
_IGNORED = {"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key", "parallel_tool_calls"}
# accepted only at their neutral value; anything else is refused by name
_NEUTRAL_COMMON = {
    "n": lambda v: v is None or (_is_int(v) and v == 1),
    "presence_penalty": lambda v: v is None or (_is_number(v) and v == 0),
    "frequency_penalty": lambda v: v is None or (_is_number(v) and v == 0),
    "logit_bias": lambda v: v is None or v == {},
    "logprobs": lambda v: v is None or v is False,
    "top_logprobs": lambda v: v is None,
    "response_format": lambda v: v is None or v == {"type": "text"},
}
_NEUTRAL_CHAT = {
    "tools": lambda v: v is None or v == [],
    "tool_choice": lambda v: v is None or v == "none",
    "functions": lambda v: v is None or v == [],
    "function_call": lambda v: v is None or v == "none",
}
_NEUTRAL_COMPLETION = {
    "echo": lambda v: v is None or v is False,
    "best_of": lambda v: v is None or (_is_int(v) and v == 1),
    "suffix": lambda v: v is None or v == "",
}
_ROLES = ("system", "developer", "user", "assistant")


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
                raise _invalid(f"{key}={json.dumps(value)[:80]} is not supported by this server (batch 1, no log "
                               f"probabilities, penalties, logit bias or tools); omit {key!r} or give its default",
                               param=key, code="unsupported_parameter")
            continue
        hint = {"prompt": " (prompt belongs to /v1/completions)",
                "messages": " (messages belongs to /v1/chat/completions)"}.get(key, "")
        raise _invalid(f"Unrecognized request argument supplied: {key}{hint}", param=key, code="unsupported_parameter")


def _chat_messages(value: Any) -> list[dict]:
    """Validate OpenAI chat messages; returns ``[{"role", "content"}]`` for the chat template."""
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
                           "(tool and function messages are not supported)", param=f"{where}.role")
        for key, v in m.items():
            if key in ("role", "content"):
                continue
            if key == "name":
                if not isinstance(v, str):
                    raise _invalid(f"{where}.name must be a string", param=f"{where}.name")
                continue
            if v is None or v == []:
                continue
            raise _invalid(f"{where}.{key} is not supported by this server", param=f"{where}.{key}",
                           code="unsupported_parameter")
        if "content" not in m:
            raise _invalid(f"{where}.content is required", param=f"{where}.content")
        content = m["content"]
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
        out.append({"role": "system" if role == "developer" else role, "content": content})
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
    if max_tokens is not None and (not _is_int(max_tokens) or max_tokens < 1):
        raise _invalid(f"{max_name} must be an integer >= 1, got {json.dumps(max_tokens)[:40]}", param=max_name)

    # the prompt, tokenized
    cfg = tf.target.model.cfg
    context = cfg.max_position_embeddings
    if kind == "chat":
        prompt_param = "messages"
        messages = _chat_messages(body.get("messages"))
        if not getattr(tf.tokenizer, "chat_template", None):
            raise _invalid("this model's tokenizer has no chat template; use /v1/completions", param="messages")
        try:
            ids = tf.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as e:  # jinja2 TemplateError (e.g. roles that must alternate) and the like
            raise _invalid(f"the chat template rejected the messages: {e}", param="messages") from e
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        ids = [int(t) for t in ids]
    else:
        prompt_param = "prompt"
        prompt = _completion_prompt(body.get("prompt"), cfg.vocab_size)
        if isinstance(prompt, str):
            ids = [int(t) for t in tf.tokenizer(prompt, add_special_tokens=True)["input_ids"]]
        else:
            ids = prompt
    if not ids:
        raise _invalid(f"{prompt_param} is empty after tokenization", param=prompt_param)
    if len(ids) >= context:
        raise _invalid(f"This model's maximum context length is {context} tokens; the {prompt_param} is {len(ids)} "
                       "tokens, which leaves no room to generate", param=prompt_param, code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = min(defaults.max_tokens, context - len(ids))
    elif len(ids) + max_tokens > context:
        raise _invalid(f"This model's maximum context length is {context} tokens. However, you requested "
                       f"{len(ids) + max_tokens} tokens ({len(ids)} in the {prompt_param}, {max_tokens} for the "
                       f"completion); reduce {max_name} to at most {context - len(ids)}", param=max_name,
                       code="context_length_exceeded")
    return GenerationRequest(kind=kind, prompt_ids=ids, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                             top_k=top_k, seed=seed, stop=stop, stream=stream, include_usage=include_usage,
                             model=defaults.model_id)


# ---------------------------------------------------------------------------------------------------- metrics
class ServerMetrics:
    """The Prometheus metrics of one server, in their own registry.

    Metrics: ``triforce_requests_total{endpoint,status}``, ``triforce_request_latency_seconds{endpoint}``
    (histogram, to the last byte of a streamed answer), ``triforce_generated_tokens_total``,
    ``triforce_prompt_tokens_total``, ``triforce_reused_prefix_tokens_total``, ``triforce_queue_depth`` (requests
    waiting), ``triforce_requests_running`` (0 or 1), ``triforce_time_to_first_token_seconds`` (histogram, from
    arrival), ``triforce_generations_ended_early_total{reason}`` (``disconnect``, ``timeout``).
    """

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        r = self.registry
        buckets = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
        self.requests = Counter("triforce_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                                registry=r)
        self.latency = Histogram("triforce_request_latency_seconds", "Request latency (streams: to the last chunk)",
                                 ["endpoint"], buckets=buckets, registry=r)
        self.generated = Counter("triforce_generated_tokens", "Tokens generated", registry=r)
        self.prompt = Counter("triforce_prompt_tokens", "Prompt tokens of generations run", registry=r)
        self.reused = Counter("triforce_reused_prefix_tokens", "Prompt tokens whose KV cache was reused", registry=r)
        self.queue_depth = Gauge("triforce_queue_depth", "Requests waiting for the engine", registry=r)
        self.running = Gauge("triforce_requests_running", "Requests the engine is running (0 or 1)", registry=r)
        self.ttft = Histogram("triforce_time_to_first_token_seconds", "From arrival to the first token",
                              buckets=buckets, registry=r)
        self.ended_early = Counter("triforce_generations_ended_early", "Generations stopped by the server",
                                   ["reason"], registry=r)

    def render(self) -> tuple[bytes, str]:
        """``(body, content type)`` of the Prometheus text exposition."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


# ---------------------------------------------------------------------------------------------------- worker
class _Abort(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class _Job:
    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    received: float  # time.monotonic() at arrival
    deadline: float
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)

    def post(self, *item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the event loop is closed (shutdown)
            pass


class GenerationWorker:
    """Runs queued generations one at a time, in arrival order, on a single thread.

    Each job receives, through its asyncio queue: ``("started", queue_seconds)`` when the engine takes it,
    ``("token", TokenEvent)`` per accepted token, then ``("done", info)`` or ``("error", APIError)``; a job
    cancelled before it started gets ``("cancelled",)``.

    Args:
        tf: the model; only this thread calls its engine.
        queue_size: most jobs waiting (not counting the one running); :meth:`submit` refuses beyond.
        metrics: counters and gauges to update.
        spec: speculation settings for every request.
    """

    def __init__(self, tf: "TriForce", queue_size: int, metrics: ServerMetrics, spec: "SpeculationConfig") -> None:
        self.tf, self.queue_size, self.metrics, self.spec = tf, queue_size, metrics, spec
        self._jobs: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._waiting = 0
        self._thread: threading.Thread | None = None
        self._current: _Job | None = None
        self._mean_seconds = 1.0  # running mean of a job's engine time, for Retry-After

    @property
    def waiting(self) -> int:
        """Jobs queued and not yet started."""
        return self._waiting

    @property
    def busy(self) -> bool:
        """Whether a job is running."""
        return self._current is not None

    def retry_after(self) -> int:
        """Seconds a refused client should wait: the expected time to drain the queue (1 to 3600)."""
        return int(min(3600, max(1, math.ceil(self._mean_seconds * (self._waiting + 1)))))

    def submit(self, job: _Job) -> bool:
        """Queue a job; False when the queue is full."""
        with self._lock:
            if self._waiting >= self.queue_size:
                return False
            self._waiting += 1
            self.metrics.queue_depth.set(self._waiting)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="triforce-engine", daemon=True)
                self._thread.start()
        self._jobs.put(job)
        return True

    def stop(self) -> None:
        """Cancel the running job and end the thread after it (jobs still queued are cancelled)."""
        cur = self._current
        if cur is not None:
            cur.cancel.set()
        self._jobs.put(None)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                while True:  # cancel what is left
                    try:
                        rest = self._jobs.get_nowait()
                    except queue.Empty:
                        return
                    if rest is not None:
                        rest.post("cancelled")
            with self._lock:
                self._waiting -= 1
                self.metrics.queue_depth.set(self._waiting)
            self._current = job
            self.metrics.running.set(1)
            t0 = time.monotonic()
            try:
                self._serve(job)
            except BaseException as e:  # noqa: BLE001 - a bug must not kill the only worker
                job.post("error", APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error"))
            finally:
                self._current = None
                self.metrics.running.set(0)
                self._mean_seconds = 0.8 * self._mean_seconds + 0.2 * (time.monotonic() - t0)

    def _serve(self, job: _Job) -> None:
        from .memory import InsufficientMemoryError
        from .sampling import SamplingParams

        req, tf, spec = job.request, self.tf, self.spec
        if job.cancel.is_set():
            job.post("cancelled")
            return
        started = time.monotonic()
        if started > job.deadline:
            self.metrics.ended_early.labels("timeout").inc()
            job.post("error", APIError(504, f"the request waited {started - job.received:.1f} s in the queue, past "
                                       "the server's --request-timeout", type="server_error", code="timeout"))
            return
        try:
            sampling = SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k)
            check_with_engine(tf, req, spec)  # free memory may have changed while the request waited
        except APIError as e:
            job.post("error", e)
            return
        job.post("started", started - job.received)

        def check(_n: int = 0) -> None:
            if job.cancel.is_set():
                raise _Abort("disconnect")
            if time.monotonic() > job.deadline:
                raise _Abort("timeout")

        gen = tf.stream(req.prompt_ids, max_new_tokens=req.max_tokens, sampling=sampling, spec=spec, seed=req.seed,
                        stop=req.stop, prefill_progress=check)
        result, ended, tokens, texts = None, None, [], []
        try:
            while True:
                try:
                    event = next(gen)
                except StopIteration as s:
                    result = s.value
                    break
                if event.token_id is not None:
                    tokens.append(event.token_id)
                texts.append(event.text)
                job.post("token", event)
                try:
                    check()
                except _Abort as a:
                    ended = a.reason
                    break
        except _Abort as a:  # raised by the prefill progress callback: no token yet
            ended = a.reason
        except (InsufficientMemoryError, ValueError) as e:
            if tokens:
                raise
            job.post("error", APIError(400, str(e), code="insufficient_memory" if isinstance(
                e, InsufficientMemoryError) else None))
            return
        finally:
            gen.close()  # stops the engine; its cache keeps exactly the tokens it processed
        if ended is not None:
            self.metrics.ended_early.labels(ended).inc()
        if result is not None:
            stats, finish, text = result.stats, result.finish_reason, result.text
        else:
            stats, finish, text = tf.engine.last_stats, "length", "".join(texts)
            if not tokens or stats is None:  # stopped during the prefill: the engine recorded nothing
                stats = _empty_stats(tf, req, spec, time.monotonic() - started)
            stats.finish_reason = "length"
        self.metrics.generated.inc(len(tokens))
        self.metrics.prompt.inc(len(req.prompt_ids))
        self.metrics.reused.inc(stats.tiers.get("target", {}).get("reused_prefix_tokens", 0) or 0)
        if ended == "disconnect":
            return  # nobody is listening
        d = stats.to_dict()
        d["queue_seconds"] = round(started - job.received, 6)
        d["timed_out"] = ended == "timeout"
        job.post("done", {"finish_reason": "length" if finish == "length" else "stop", "text": text,
                          "completion_tokens": len(tokens), "stats": d})


def check_with_engine(tf: "TriForce", req: GenerationRequest, spec: "SpeculationConfig") -> None:
    """The engine's own checks of a request (vocabulary, draft model, sliding window, free memory).

    Raises:
        APIError: 400, with the engine's message (``code`` ``insufficient_memory`` when the caches do not fit).
    """
    from .memory import InsufficientMemoryError

    try:
        tf.engine.validate(req.prompt_ids, req.max_tokens, spec)
    except InsufficientMemoryError as e:
        raise APIError(400, str(e), param="max_tokens", code="insufficient_memory") from e
    except ValueError as e:
        raise _invalid(str(e)) from e


def _empty_stats(tf: "TriForce", req: GenerationRequest, spec: "SpeculationConfig", seconds: float):
    from .engine import GenerationStats
    from .memory import peak_memory_bytes

    return GenerationStats(mode=spec.name, prompt_tokens=len(req.prompt_ids), generated_tokens=0,
                           finish_reason="length", prefill_seconds=round(seconds, 6), decode_seconds=0.0,
                           decode_tokens_per_second=0.0, mean_time_between_tokens_ms=0.0,
                           peak_memory_bytes=peak_memory_bytes(tf.target.model.device), seed=req.seed or 0, tiers={})


# ---------------------------------------------------------------------------------------------------- app
def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8") + b"\n\n"


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def create_app(tf: "TriForce", defaults: ServerDefaults | None = None) -> "FastAPI":
    """The FastAPI application serving ``tf``.

    Args:
        tf: a loaded :class:`~triforce.api.TriForce`; the app's single worker thread is the only caller of its
            engine once the app serves requests.
        defaults: server settings and request defaults (None: :class:`ServerDefaults` with the model id taken
            from ``tf.target.source``).

    Returns:
        the app; ``app.state.worker`` is the :class:`GenerationWorker`, ``app.state.metrics`` the
        :class:`ServerMetrics`.

    Raises:
        ImportError: FastAPI or prometheus_client are not installed (``pip install 'triforce[serve]'``).
    """
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    if defaults is None:
        source = getattr(getattr(tf, "target", None), "source", None)
        defaults = ServerDefaults(model_id=model_id_for(source), model_aliases=(str(source),) if source else ())
    spec = defaults.spec
    if spec is None:
        from .engine import SpeculationConfig

        spec = SpeculationConfig(mode=tf.default_mode, drafter=tf.drafter)
    metrics = ServerMetrics()
    worker = GenerationWorker(tf, defaults.queue_size, metrics, spec)

    @asynccontextmanager
    async def lifespan(_app):
        yield
        worker.stop()

    app = FastAPI(title="triforce", version=_version(), lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.worker, app.state.metrics, app.state.defaults, app.state.tf = worker, metrics, defaults, tf

    def error_response(err: APIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x not in ("body", "query", "path", "header")]
        param = ".".join(loc) or None
        return error_response(_invalid(f"{param or 'request'}: {first.get('msg', 'invalid value')}", param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(APIError(exc.status_code, str(exc.detail), type=kind,
                                       headers=dict(exc.headers or {})))

    @app.exception_handler(Exception)
    async def _internal_error(_request: Request, exc: Exception):
        return error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error"))

    class _Metered:
        """ASGI middleware: counts requests by endpoint and status, times them to their last byte."""

        def __init__(self, app) -> None:
            self.inner = app

        async def __call__(self, scope, receive, send):
            if scope["type"] != "http":
                return await self.inner(scope, receive, send)
            t0, status = time.perf_counter(), [500]

            async def send_status(message):
                if message["type"] == "http.response.start":
                    status[0] = message["status"]
                await send(message)

            try:
                await self.inner(scope, receive, send_status)
            finally:
                path = scope.get("path", "")
                endpoint = path if path in ENDPOINTS else ("/v1/models" if path.startswith("/v1/models/") else "other")
                metrics.requests.labels(endpoint, str(status[0])).inc()
                metrics.latency.labels(endpoint).observe(time.perf_counter() - t0)

    class _RequireKey:
        """ASGI middleware: with ``defaults.api_key``, answer 401 to requests (all but ``/health``) without
        ``Authorization: Bearer <key>``; the key is compared in constant time and never logged or echoed."""

        def __init__(self, app) -> None:
            self.inner = app
            self.key = defaults.api_key.encode("ascii")

        async def __call__(self, scope, receive, send):
            if scope["type"] == "http" and scope.get("path", "") not in OPEN_PATHS:
                auth = dict(scope.get("headers") or ()).get(b"authorization", b"")
                scheme, _, token = auth.partition(b" ")
                if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                    err = APIError(401, "missing or incorrect API key: send it as 'Authorization: Bearer <key>' "
                                        "(the key given to the server with --api-key or $" + API_KEY_ENV + ")",
                                   code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                    return await error_response(err)(scope, receive, send)
            return await self.inner(scope, receive, send)

    if defaults.api_key is not None:
        app.add_middleware(_RequireKey)  # inside _Metered, so 401s are counted like any answer
    app.add_middleware(_Metered)

    class _JobStream(StreamingResponse):
        """A streamed answer that cancels its job however the response ends (client gone included)."""

        def __init__(self, job: _Job, content, **kw) -> None:
            super().__init__(content, **kw)
            self.job = job

        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                self.job.cancel.set()

    async def next_event(job: _Job, request: Request) -> tuple | None:
        """The job's next event; None once the client has disconnected (checked at every call, i.e. between
        tokens, and every DISCONNECT_POLL_SECONDS while waiting)."""
        while True:
            if await request.is_disconnected():
                return None
            try:
                return job.events.get_nowait()
            except asyncio.QueueEmpty:
                pass
            try:
                return await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_SECONDS)
            except asyncio.TimeoutError:
                pass

    async def read_body(request: Request) -> dict:
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > MAX_BODY_BYTES:
            raise APIError(413, f"request body is {length} bytes; the limit is {MAX_BODY_BYTES}", code="body_too_large")
        return parse_json_body(await request.body())

    async def generate(request: Request, kind: str):
        received = time.monotonic()
        req = parse_request(await read_body(request), kind, tf, defaults)
        check_with_engine(tf, req, spec)  # refuse what cannot fit before queueing it
        job = _Job(req, asyncio.get_running_loop(), received, received + defaults.request_timeout)
        if not worker.submit(job):
            raise APIError(503, f"the server is busy: {worker.waiting} requests are already waiting (--queue-size "
                           f"{defaults.queue_size}); retry later", type="server_error", code="queue_full",
                           headers={"Retry-After": str(worker.retry_after())})
        try:
            first = await next_event(job, request)
        except BaseException:
            job.cancel.set()
            raise
        if first is None or first[0] == "cancelled":
            job.cancel.set()
            return Response(status_code=499)  # client closed the request (nginx's code); nobody reads it
        if first[0] == "error":
            raise first[1]
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        if req.stream:
            return _JobStream(job, stream_body(job, request, req, rid, created), media_type="text/event-stream",
                              headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            text, first_token = [], True
            while True:
                ev = await next_event(job, request)
                if ev is None:
                    return Response(status_code=499)
                if ev[0] == "token":
                    if first_token:
                        metrics.ttft.observe(time.monotonic() - received)
                        first_token = False
                    text.append(ev[1].text)
                elif ev[0] == "error":
                    raise ev[1]
                elif ev[0] == "done":
                    info = ev[1]
                    break
        finally:
            job.cancel.set()
        usage = _usage(len(req.prompt_ids), info["completion_tokens"])
        if kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": info["text"]}, "logprobs": None,
                      "finish_reason": info["finish_reason"]}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": info["text"], "logprobs": None, "finish_reason": info["finish_reason"]}
            obj = "text_completion"
        return JSONResponse({"id": rid, "object": obj, "created": created, "model": req.model, "choices": [choice],
                             "usage": usage, "triforce": info["stats"]})

    async def stream_body(job: _Job, request: Request, req: GenerationRequest, rid: str, created: int):
        chat = req.kind == "chat"
        obj = "chat.completion.chunk" if chat else "text_completion"
        extra = {"usage": None} if req.include_usage else {}

        def chunk(delta: str | None, finish: str | None = None, role: bool = False) -> dict:
            if chat:
                d = {"role": "assistant", "content": ""} if role else ({} if delta is None else {"content": delta})
                c = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}
            else:
                c = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
            return {"id": rid, "object": obj, "created": created, "model": req.model, "choices": [c], **extra}

        try:
            if chat:
                yield _sse(chunk(None, role=True))
            first_token = True
            while True:
                ev = await next_event(job, request)
                if ev is None:
                    job.cancel.set()
                    return
                if ev[0] == "token":
                    if first_token:
                        metrics.ttft.observe(time.monotonic() - job.received)
                        first_token = False
                    if ev[1].text:
                        yield _sse(chunk(ev[1].text))
                elif ev[0] == "error":
                    yield _sse(ev[1].body())
                    yield b"data: [DONE]\n\n"
                    return
                elif ev[0] == "done":
                    info = ev[1]
                    final = chunk(None, finish=info["finish_reason"])
                    final["triforce"] = info["stats"]
                    yield _sse(final)
                    if req.include_usage:
                        yield _sse({"id": rid, "object": obj, "created": created, "model": req.model, "choices": [],
                                    "usage": _usage(len(req.prompt_ids), info["completion_tokens"])})
                    yield b"data: [DONE]\n\n"
                    return
        finally:
            job.cancel.set()

    @app.get("/health")
    async def health():
        """Liveness: 200 with the model id and the queue state."""
        return {"status": "ok", "model": defaults.model_id, "queue_depth": worker.waiting, "busy": worker.busy}

    def model_card() -> dict:
        return {"id": defaults.model_id, "object": "model", "created": 0, "owned_by": "triforce"}

    @app.get("/v1/models")
    async def list_models():
        """The one model served."""
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        """The model card, or 404."""
        if model_id not in (defaults.model_id, *defaults.model_aliases):
            raise APIError(404, f"The model {model_id!r} does not exist; this server serves {defaults.model_id!r}",
                           param="model", code="model_not_found")
        return model_card()

    @app.post("/v1/completions")
    async def completions(request: Request):
        """OpenAI text completions (prompt string or token ids)."""
        return await generate(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        """OpenAI chat completions (messages through the tokenizer's chat template)."""
        return await generate(request, "chat")

    @app.get("/metrics")
    async def prometheus():
        """Prometheus text exposition."""
        body, ctype = metrics.render()
        return Response(body, media_type=ctype)

    return app


def _version() -> str:
    from . import __version__

    return __version__


# ---------------------------------------------------------------------------------------------------- command line
def add_serve_parser(subparsers: "argparse._SubParsersAction") -> argparse.ArgumentParser:
    """Add the ``serve`` subcommand (the generation options plus ``--host``, ``--port``, ``--queue-size``,
    ``--request-timeout``) to ``subparsers``; returns its parser. Dispatch to :func:`cmd_serve`."""
    from .cli import _add_generation_args

    p = subparsers.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API",
                              description="OpenAI-compatible server (/v1/completions, /v1/chat/completions, /v1/models, "
                                          "/health, /metrics); requests run one at a time in arrival order. The "
                                          "sampling options are the defaults of requests that omit them.")
    _add_generation_args(p)
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free port, printed)")
    s.add_argument("--queue-size", type=int, default=16,
                   help="requests that may wait for the engine besides the running one; more get 503 (default 16)")
    s.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds from a request's arrival after which its generation ends with finish_reason "
                        "'length' (default 600)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn log level (default info)")
    s.add_argument("--api-key", help=f"require 'Authorization: Bearer KEY' on every request but /health (401 "
                                     f"otherwise); default: ${API_KEY_ENV} if set, else no key. The variable keeps "
                                     "the key out of the process list")
    return p


def _defaults_from_args(args: argparse.Namespace) -> ServerDefaults:
    """Check the options (before anything is loaded) and turn them into :class:`ServerDefaults`.

    Raises:
        CLIError: a bad option, named.
    """
    from .cli import CLIError, _option_error, check_seed, check_threads, spec_from_args
    from .sampling import SamplingParams

    check_threads(args.threads)
    if args.tp != 1:
        raise CLIError("--tp: triforce serve runs in one process; tensor parallelism is for `torchrun ... -m triforce "
                       "generate --tp N`")
    if args.on_chip_layers is not None and not args.offload_kv:
        raise CLIError("--on-chip-layers needs --offload-kv")
    if not 0 <= args.port <= 65535:
        raise CLIError(f"--port must be in [0, 65535], got {args.port}")
    if args.queue_size < 1:
        raise CLIError(f"--queue-size must be >= 1, got {args.queue_size}")
    if not (args.request_timeout > 0 and math.isfinite(args.request_timeout)):
        raise CLIError(f"--request-timeout must be a number of seconds > 0, got {args.request_timeout}")
    if args.max_new_tokens < 1:
        raise CLIError(f"--max-new-tokens must be an integer >= 1, got {args.max_new_tokens}")
    if any(not s for s in args.stop):
        raise CLIError("--stop strings must not be empty")
    check_seed(args.seed)
    try:
        SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
        spec = spec_from_args(args, has_draft=args.draft is not None)
    except ValueError as e:
        raise _option_error(e) from e
    if args.temperature > 2:
        raise CLIError(f"--temperature must be in [0, 2] for the server, got {args.temperature}")
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    if api_key is not None:
        try:
            check_api_key(api_key, "--api-key" if args.api_key is not None else "$" + API_KEY_ENV)
        except ValueError as e:
            raise CLIError(str(e)) from e
    return ServerDefaults(model_id=model_id_for(args.model), model_aliases=(args.model,) if args.model else (),
                          max_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed, stop=tuple(args.stop), spec=spec,
                          queue_size=args.queue_size, request_timeout=args.request_timeout, api_key=api_key)


def cmd_serve(args: argparse.Namespace) -> int:
    """Run ``triforce serve`` until interrupted; returns the exit status (0 after Ctrl-C / SIGTERM).

    Options are checked before the model is loaded; the port is bound before the model is loaded too, so a port
    in use fails at once.

    Raises:
        CLIError: a bad option, a missing ``serve`` extra, or an address that cannot be bound.
        ModelLoadError, InsufficientMemoryError: from loading the model.
    """
    import socket

    from .cli import CLIError

    defaults = _defaults_from_args(args)
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn
    except ImportError as e:
        raise CLIError(f"triforce serve needs the 'serve' extra ({e.name} is missing): "
                       "pip install 'triforce[serve]'") from e
    try:
        info = socket.getaddrinfo(args.host, args.port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(info[0], socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(info[4])
        sock.listen(2048)
    except OSError as e:
        raise CLIError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from e
    from .api import TriForce

    try:
        tf = TriForce.load(args.model, args.draft, dtype=args.dtype, device=args.device, offload_kv=args.offload_kv,
                           on_chip_layers=args.on_chip_layers, kv_dtype=args.kv_dtype, quantize=args.quantize,
                           packed_weights={"auto": None, "on": True, "off": False}[args.packed_weights],
                           threads="auto" if args.threads is None else args.threads)
        if args.compile:
            tf.compile(args.compile)
        app = create_app(tf, defaults)
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        print(f"triforce serve: {defaults.model_id} ({defaults.spec.name if defaults.spec else tf.default_mode}) on "
              f"http://{shown}:{port}/v1{' (API key required)' if defaults.api_key else ''}", file=sys.stderr,
              flush=True)
        config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=3, lifespan="on")
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
    return 0


def main_for_tests(argv: list[str] | None = None) -> int:
    """``python -m triforce.server [serve options]``: the ``serve`` subcommand without the main CLI; returns the
    exit status (2 and one line on stderr for bad input)."""
    from .cli import CLIError
    from .loading import ModelLoadError
    from .memory import InsufficientMemoryError

    parser = argparse.ArgumentParser(prog="python -m triforce.server")
    sub = parser.add_subparsers(dest="command")
    add_serve_parser(sub)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "serve":
        argv = ["serve", *argv]
    args = parser.parse_args(argv)
    try:
        return cmd_serve(args)
    except (CLIError, ModelLoadError, InsufficientMemoryError, ValueError) as e:
        print(f"triforce: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main_for_tests())
