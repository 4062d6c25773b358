"""``triforce serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one :class:`~triforce.api.TriForce`.

Endpoints: ``GET /health``, ``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (both streamed as server-sent events with ``"stream": true``), ``GET /metrics``
(Prometheus text format). Documentation: docs/server.md.

Modules: ``settings`` (errors, server settings), ``schema`` (OpenAI request validation), ``metrics``
(Prometheus), ``worker`` (the engine's thread), ``app`` (the FastAPI app and its streaming). The ``serve`` subcommand
(options, start-up) is ``triforce.cli.serve``.

Design: one worker thread runs the engine. Requests are validated and tokenized on the event loop, then queued;
the worker runs up to ``--max-batch`` of them at once in arrival order, their forwards batched
(:class:`~triforce.serve.worker.GenerationWorker`), each with its own engine state, and a request may reuse the KV
cache of an earlier one (longest common token prefix). Tokens travel from the worker to the request's coroutine
through an asyncio queue. Between tokens (and between prefill chunks) the worker checks whether the request was
cancelled (client disconnected) or ran past its deadline, and then closes the token generator, which stops the
engine and leaves its cache consistent for the next request.

FastAPI, uvicorn and prometheus_client (the ``serve`` extra) are imported only when a server is built, so the
rest of the command line works without them.
"""

from .app import create_app, run_app
from .metrics import ServerMetrics
from .schema import GenerationRequest, parse_json_body, parse_request
from .settings import API_KEY_ENV, DEFAULT_MODEL_ID, APIError, ServerDefaults, check_api_key, model_id_for
from .worker import GenerationWorker

__all__ = ["create_app", "run_app", "ServerMetrics", "GenerationRequest", "parse_json_body", "parse_request",
           "API_KEY_ENV", "DEFAULT_MODEL_ID", "APIError", "ServerDefaults", "check_api_key", "model_id_for",
           "GenerationWorker"]
