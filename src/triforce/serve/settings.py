"""``triforce serve``: the server's errors (OpenAI's error body), its settings and request defaults."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..defaults import DEFAULTS, SERVE_DEFAULTS

if TYPE_CHECKING:  # pragma: no cover
    from ..speculation.hierarchy import SpeculationConfig

DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"
MAX_BODY_BYTES = 16 * 1024 * 1024
MAX_STOP_SEQUENCES = 4
MAX_CHOICES = 16  # most choices (`n`) of one request; each is a sequence of the batch
DISCONNECT_POLL_SECONDS = 0.25
API_KEY_ENV = "TRIFORCE_API_KEY"
OPEN_PATHS = ("/health",)  # answered without the API key (load balancers' liveness checks)
ENDPOINTS = ("/health", "/v1/models", "/v1/completions", "/v1/chat/completions", "/metrics")


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
        queue_size: most requests waiting for the engine (not counting the running ones); more get 503.
        max_batch: most requests the engine runs at once, their forwards batched (continuous batching; 1: one at a
            time in arrival order).
        prefix_cache_gib: GiB of KV cache idle requests keep for prefix reuse, in all (least recently used dropped
            first; the last request's cache is kept even when larger, so a chat's next turn reuses it; 0: only it).
        request_timeout: seconds from a request's arrival after which its generation ends.
        api_key: when set, every request except ``GET /health`` must carry ``Authorization: Bearer <api_key>``
            (what OpenAI clients send), else 401 in OpenAI's error format. Never printed (not in ``repr``).
    """

    model_id: str = DEFAULT_MODEL_ID
    model_aliases: tuple[str, ...] = ()
    max_tokens: int = DEFAULTS["max_new_tokens"]
    temperature: float = DEFAULTS["temperature"]
    top_p: float = DEFAULTS["top_p"]
    top_k: int = DEFAULTS["top_k"]
    seed: int | None = DEFAULTS["seed"]
    stop: tuple[str, ...] = ()
    spec: "SpeculationConfig | None" = None
    queue_size: int = SERVE_DEFAULTS["queue_size"]
    max_batch: int = DEFAULTS["max_batch"]
    prefix_cache_gib: float = SERVE_DEFAULTS["prefix_cache_gib"]
    request_timeout: float = SERVE_DEFAULTS["request_timeout"]
    api_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.api_key is not None:
            check_api_key(self.api_key, "api_key")
        if not isinstance(self.queue_size, int) or self.queue_size < 1:
            raise ValueError(f"queue_size must be an integer >= 1, got {self.queue_size!r}")
        if isinstance(self.max_batch, bool) or not isinstance(self.max_batch, int) or self.max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1, got {self.max_batch!r}")
        if isinstance(self.prefix_cache_gib, bool) or not isinstance(self.prefix_cache_gib, (int, float)) \
                or not 0 <= self.prefix_cache_gib < float("inf"):
            raise ValueError(f"prefix_cache_gib must be a number of GiB >= 0, got {self.prefix_cache_gib!r}")
        if isinstance(self.request_timeout, bool) or not isinstance(self.request_timeout, (int, float)) \
                or not 0 < self.request_timeout < float("inf"):
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
