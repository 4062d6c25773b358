"""``triforce serve``: the FastAPI application: endpoints, middleware (metrics, API key), answers and streams.

FastAPI, starlette and uvicorn are imported inside the functions that need them, so importing this module (and the
rest of ``triforce.serve``) works without the ``serve`` extra.
"""

# (no ``from __future__ import annotations``: FastAPI reads the endpoints' annotations, e.g. ``Request``, at runtime)
import asyncio
import functools
import hmac
import json
import time
import uuid
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ..speculation.hierarchy import MAX_SEED
from .logprob_fields import chat_logprobs, completion_logprobs
from .metrics import ServerMetrics
from .schema import GenerationRequest, parse_json_body, parse_request
from .settings import (
    API_KEY_ENV,
    DISCONNECT_POLL_SECONDS,
    ENDPOINTS,
    MAX_BODY_BYTES,
    OPEN_PATHS,
    APIError,
    ServerDefaults,
    _invalid,
    model_id_for,
)
from .tools import ToolCallParser
from .worker import GenerationWorker, _Job, check_with_engine

if TYPE_CHECKING:  # pragma: no cover
    from fastapi import FastAPI

    from ..api import TriForce
    from ..speculation.hierarchy import SpeculationConfig


def _sse(obj: Any) -> bytes:
    """One server-sent event carrying ``obj`` as compact JSON."""
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8") + b"\n\n"


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _error_response(err: APIError):
    """The JSON response of an :class:`APIError` (OpenAI's error body, its status and headers)."""
    from fastapi.responses import JSONResponse

    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


# ---------------------------------------------------------------------------------------------------- middleware
class _Metered:
    """ASGI middleware: counts requests by endpoint and status, times them to their last byte."""

    def __init__(self, app, metrics: ServerMetrics) -> None:
        self.inner, self.metrics = app, metrics

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
            self.metrics.requests.labels(endpoint, str(status[0])).inc()
            self.metrics.latency.labels(endpoint).observe(time.perf_counter() - t0)


class _RequireKey:
    """ASGI middleware: answer 401 to requests (all but ``/health``) without ``Authorization: Bearer <key>``; the
    key is compared in constant time and never logged or echoed."""

    def __init__(self, app, key: str) -> None:
        self.inner, self.key = app, key.encode("ascii")

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope.get("path", "") not in OPEN_PATHS:
            auth = dict(scope.get("headers") or ()).get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                err = APIError(401, "missing or incorrect API key: send it as 'Authorization: Bearer <key>' "
                                    "(the key given to the server with --api-key or $" + API_KEY_ENV + ")",
                               code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                return await _error_response(err)(scope, receive, send)
        return await self.inner(scope, receive, send)


def _cancel(jobs: list[_Job]) -> None:
    """Cancel every choice of a request (no effect on those that ended)."""
    for job in jobs:
        job.cancel.set()


def _choices(req: GenerationRequest, loop, received: float, deadline: float) -> list[_Job]:
    """The jobs of a request's ``n`` choices, sharing one event queue; choice i samples with ``seed + i`` (a random
    seed each without a seed). The first carries the others as its followers (``worker.py``)."""
    events: asyncio.Queue = asyncio.Queue()
    jobs = []
    for i in range(req.n):
        seed = req.seed if req.seed is None or i == 0 else (req.seed + i) % (MAX_SEED + 1)
        jobs.append(_Job(replace(req, seed=seed), loop, received, deadline, events=events, index=i))
    jobs[0].followers = jobs[1:]
    return jobs


@functools.lru_cache(maxsize=None)
def _job_stream_class():
    """``StreamingResponse`` that cancels its jobs however the response ends (client gone included)."""
    from starlette.responses import StreamingResponse

    class _JobStream(StreamingResponse):
        def __init__(self, jobs: list[_Job], content, **kw) -> None:
            super().__init__(content, **kw)
            self.jobs = jobs

        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                _cancel(self.jobs)

    return _JobStream


# ---------------------------------------------------------------------------------------------------- answers
@dataclass
class _Server:
    """What the endpoints share: the model, the settings, the speculation settings, the worker and the metrics."""

    tf: "TriForce"
    defaults: ServerDefaults
    spec: "SpeculationConfig"
    worker: GenerationWorker
    metrics: ServerMetrics

    async def next_event(self, job: _Job, request) -> tuple | None:
        """The next ``(choice index, event)`` of the job's request; None once the client has disconnected (checked
        at every call, i.e. between tokens, and every DISCONNECT_POLL_SECONDS while waiting)."""
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

    async def read_body(self, request) -> dict:
        """The request's JSON object (413 past :data:`MAX_BODY_BYTES`, 400 not a JSON object)."""
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > MAX_BODY_BYTES:
            raise APIError(413, f"request body is {length} bytes; the limit is {MAX_BODY_BYTES}", code="body_too_large")
        return parse_json_body(await request.body())

    async def generate(self, request, kind: str):
        """``POST /v1/completions`` (``kind`` ``completion``) and ``/v1/chat/completions`` (``chat``): validate,
        queue, then answer in one JSON object or as server-sent events."""
        from fastapi.responses import Response

        received = time.monotonic()
        req = parse_request(await self.read_body(request), kind, self.tf, self.defaults)
        try:
            check_with_engine(self.tf, req, self.spec)  # refuse what cannot fit before queueing it
        except APIError as e:
            # memory held by running requests or kept caches frees up: the worker checks again when it starts
            if e.code != "insufficient_memory" or not (self.worker.busy or self.worker.keeps_caches):
                raise
        if req.n > self.defaults.queue_size:
            raise _invalid(f"n={req.n} choices cannot all wait in the server's queue (--queue-size "
                           f"{self.defaults.queue_size}); ask for at most {self.defaults.queue_size}", param="n")
        jobs = _choices(req, asyncio.get_running_loop(), received, received + self.defaults.request_timeout)
        job = jobs[0]
        if not self.worker.submit(job):
            raise APIError(503, f"the server is busy: {self.worker.waiting} requests are already waiting (--queue-size "
                           f"{self.defaults.queue_size}); retry later", type="server_error", code="queue_full",
                           headers={"Retry-After": str(self.worker.retry_after())})
        try:
            first = await self.next_event(job, request)
        except BaseException:
            _cancel(jobs)
            raise
        if first is None or first[1][0] == "cancelled":
            _cancel(jobs)
            return Response(status_code=499)  # client closed the request (nginx's code); nobody reads it
        if first[1][0] == "error":
            _cancel(jobs)
            raise first[1][1]
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        if req.stream:
            return _job_stream_class()(jobs, self.stream_body(jobs, request, req, rid, created),
                                       media_type="text/event-stream",
                                       headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            return await self.answer(job, request, req, rid, created)
        finally:
            _cancel(jobs)

    async def answer(self, job: _Job, request, req: GenerationRequest, rid: str, created: int):
        """The non-streamed answer: collect the tokens of every choice, then one JSON object (499 if the client
        left). ``triforce`` holds the first choice's stats, and with ``n`` > 1 every choice's as ``choices``."""
        from fastapi.responses import JSONResponse, Response

        first_token = True
        entries: list[list[tuple[dict, str]]] = [[] for _ in range(req.n)]  # (entry, text piece) of each choice's
        prompt_entries: list[tuple[dict, str]] = []  # ... and of the echoed prompt's (n = 1)
        infos: dict[int, dict] = {}
        while len(infos) < req.n:
            item = await self.next_event(job, request)
            if item is None:
                return Response(status_code=499)
            i, ev = item
            if ev[0] == "token":
                if first_token:
                    self.metrics.ttft.observe(time.monotonic() - job.received)
                    first_token = False
                if ev[2] is not None:
                    entries[i].append(ev[2])
            elif ev[0] == "prompt_logprobs":
                prompt_entries = ev[1]
            elif ev[0] == "error":
                raise ev[1]
            elif ev[0] == "cancelled":
                return Response(status_code=499)
            elif ev[0] == "done":
                infos[i] = ev[1]
        choices = []
        for i in range(req.n):
            info, logprobs = infos[i], None
            if req.kind == "chat":
                if req.logprobs is not None:
                    logprobs = chat_logprobs(entries[i])
                message, finish = {"role": "assistant", "content": info["text"]}, info["finish_reason"]
                if req.tools is not None:  # the model's <tool_call> blocks as tool_calls (tools.py)
                    message["content"], calls = ToolCallParser.parse(info["text"], req.tools.names)
                    if calls:
                        message["tool_calls"], finish = calls, ("tool_calls" if finish == "stop" else finish)
                choices.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish})
            else:
                echoed = self.echo_text(req)
                if req.logprobs is not None:  # the completion's offsets start after the echoed prompt
                    prompt, _ = completion_logprobs(prompt_entries, 0)
                    logprobs = {k: v + completion_logprobs(entries[i], len(echoed))[0][k] for k, v in prompt.items()}
                choices.append({"index": i, "text": echoed + info["text"], "logprobs": logprobs,
                                "finish_reason": info["finish_reason"]})
        usage = _usage(len(req.prompt_ids), sum(info["completion_tokens"] for info in infos.values()))
        stats = infos[0]["stats"] if req.n == 1 else dict(infos[0]["stats"],
                                                          choices=[infos[i]["stats"] for i in range(req.n)])
        obj = "chat.completion" if req.kind == "chat" else "text_completion"
        return JSONResponse({"id": rid, "object": obj, "created": created, "model": req.model, "choices": choices,
                             "usage": usage, "triforce": stats})

    async def stream_body(self, jobs: list[_Job], request, req: GenerationRequest, rid: str, created: int):
        """The server-sent events of a streamed answer: chunks as tokens arrive (each names its choice's
        ``index``), each choice's final chunk with its stats, the usage chunk (``stream_options.include_usage``),
        ``[DONE]``."""
        chat = req.kind == "chat"
        obj = "chat.completion.chunk" if chat else "text_completion"
        extra = {"usage": None} if req.include_usage else {}

        offset = [0] * req.n  # completions: characters of text sent so far (text_offset), per choice
        pending: list[list[tuple[dict, str]]] = [[] for _ in range(req.n)]  # (entry, text piece) not sent yet

        parsers = [ToolCallParser(req.tools.names) for _ in range(req.n)] if req.tools is not None else None

        def chunk(i: int, delta: str | None, finish: str | None = None, role: bool = False,
                  tool_calls: list | None = None) -> dict:
            lp = None
            if pending[i]:  # OpenAI's null where a chunk carries no token's log-probability
                if chat:
                    lp = chat_logprobs(pending[i])
                else:
                    lp, offset[i] = completion_logprobs(pending[i], offset[i])
                pending[i] = []
            if chat:
                d = {"role": "assistant", "content": ""} if role else ({} if delta is None else {"content": delta})
                if tool_calls:
                    d["tool_calls"] = tool_calls
                c = {"index": i, "delta": d, "logprobs": lp, "finish_reason": finish}
            else:
                c = {"index": i, "text": delta or "", "logprobs": lp, "finish_reason": finish}
            return {"id": rid, "object": obj, "created": created, "model": req.model, "choices": [c], **extra}

        try:
            if chat:
                for i in range(req.n):
                    yield _sse(chunk(i, None, role=True))
            first_token = True
            echoed = "" if chat else self.echo_text(req)
            if echoed and req.logprobs is None:
                yield _sse(chunk(0, echoed))
            completion_tokens, done = 0, 0
            while done < req.n:
                item = await self.next_event(jobs[0], request)
                if item is None:
                    return
                i, ev = item
                if ev[0] == "token":
                    if first_token:
                        self.metrics.ttft.observe(time.monotonic() - jobs[0].received)
                        first_token = False
                    if ev[2] is not None:
                        pending[i].append(ev[2])
                    if parsers is not None and ev[1].text:  # text held while it may open a <tool_call> block
                        text, calls = parsers[i].feed(ev[1].text)
                        for k, call in enumerate(calls, start=parsers[i].calls - len(calls)):
                            yield _sse(chunk(i, None, tool_calls=[dict(call, index=k)]))
                        if text:
                            yield _sse(chunk(i, text))
                    elif ev[1].text:
                        yield _sse(chunk(i, ev[1].text))
                elif ev[0] == "prompt_logprobs":  # echo: the prompt and its tokens' log-probabilities first
                    pending[i] = ev[1]
                    yield _sse(chunk(i, echoed))
                    offset[i] = len(echoed)  # the completion's text follows the prompt as sent
                elif ev[0] in ("error", "cancelled"):
                    if ev[0] == "error":
                        yield _sse(ev[1].body())
                    yield b"data: [DONE]\n\n"
                    return
                elif ev[0] == "done":
                    info, finish = ev[1], ev[1]["finish_reason"]
                    if parsers is not None:
                        rest, calls = parsers[i].finish()
                        if rest:
                            yield _sse(chunk(i, rest))
                        for k, call in enumerate(calls, start=parsers[i].calls - len(calls)):
                            yield _sse(chunk(i, None, tool_calls=[dict(call, index=k)]))
                        if parsers[i].calls and finish == "stop":
                            finish = "tool_calls"
                    final = chunk(i, None, finish=finish)
                    final["triforce"] = info["stats"]
                    yield _sse(final)
                    completion_tokens += info["completion_tokens"]
                    done += 1
            if req.include_usage:
                yield _sse({"id": rid, "object": obj, "created": created, "model": req.model, "choices": [],
                            "usage": _usage(len(req.prompt_ids), completion_tokens)})
            yield b"data: [DONE]\n\n"
        finally:
            _cancel(jobs)

    def echo_text(self, req: GenerationRequest) -> str:
        """What ``echo`` puts before a completion: the prompt as sent, or the decoded token ids ("" without echo)."""
        if not req.echo:
            return ""
        return req.prompt_text if req.prompt_text is not None else self.tf.tokenizer.decode(req.prompt_ids)

    def model_card(self) -> dict:
        """The one model served, as ``/v1/models`` lists it."""
        return {"id": self.defaults.model_id, "object": "model", "created": 0, "owned_by": "triforce"}


def _add_error_handlers(app) -> None:
    """Every error answers in OpenAI's format: ours, FastAPI's validation errors, HTTP errors, and bugs (500)."""
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    @app.exception_handler(APIError)
    async def _api_error(_request, exc: APIError):
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x not in ("body", "query", "path", "header")]
        param = ".".join(loc) or None
        return _error_response(_invalid(f"{param or 'request'}: {first.get('msg', 'invalid value')}", param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error_response(APIError(exc.status_code, str(exc.detail), type=kind, headers=dict(exc.headers or {})))

    @app.exception_handler(Exception)
    async def _internal_error(_request, exc: Exception):
        return _error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error"))


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
    from fastapi.responses import Response

    from .. import __version__

    if defaults is None:
        source = getattr(getattr(tf, "target", None), "source", None)
        defaults = ServerDefaults(model_id=model_id_for(source), model_aliases=(str(source),) if source else ())
    spec = defaults.spec
    if spec is None:
        from ..speculation.hierarchy import SpeculationConfig

        spec = SpeculationConfig(mode=tf.default_mode, drafter=tf.drafter)
    metrics = ServerMetrics()
    worker = GenerationWorker(tf, defaults.queue_size, metrics, spec, max_batch=defaults.max_batch,
                              prefix_cache_bytes=int(defaults.prefix_cache_gib * 2**30))
    server = _Server(tf, defaults, spec, worker, metrics)

    @asynccontextmanager
    async def lifespan(_app):
        yield
        worker.stop()

    app = FastAPI(title="triforce", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.worker, app.state.metrics, app.state.defaults, app.state.tf = worker, metrics, defaults, tf
    _add_error_handlers(app)
    if defaults.api_key is not None:
        app.add_middleware(_RequireKey, key=defaults.api_key)  # inside _Metered, so 401s are counted like any answer
    app.add_middleware(_Metered, metrics=metrics)

    @app.get("/health")
    async def health():
        """Liveness: 200 with the model id and the queue state."""
        return {"status": "ok", "model": defaults.model_id, "queue_depth": worker.waiting, "busy": worker.busy,
                "running": worker.running, "max_batch": worker.max_batch}

    @app.get("/v1/models")
    async def list_models():
        """The one model served."""
        return {"object": "list", "data": [server.model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        """The model card, or 404."""
        if model_id not in (defaults.model_id, *defaults.model_aliases):
            raise APIError(404, f"The model {model_id!r} does not exist; this server serves {defaults.model_id!r}",
                           param="model", code="model_not_found")
        return server.model_card()

    @app.post("/v1/completions")
    async def completions(request: Request):
        """OpenAI text completions (prompt string or token ids)."""
        return await server.generate(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        """OpenAI chat completions (messages through the tokenizer's chat template)."""
        return await server.generate(request, "chat")

    @app.get("/metrics")
    async def prometheus():
        """Prometheus text exposition."""
        body, ctype = metrics.render()
        return Response(body, media_type=ctype)

    return app


def run_app(app, sock, log_level: str = "info") -> None:
    """Serve ``app`` with uvicorn on the bound, listening socket ``sock`` until interrupted (Ctrl-C, SIGTERM).

    Raises:
        ImportError: uvicorn is not installed (``pip install 'triforce[serve]'``).
    """
    import uvicorn

    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=3, lifespan="on")
    uvicorn.Server(config).run(sockets=[sock])
