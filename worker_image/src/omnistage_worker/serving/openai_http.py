"""OpenAI-compatible HTTP beside gRPC (starlette app, served by uvicorn in the worker's loop).

``/v1/completions`` and ``/v1/chat/completions`` (SSE with ``stream: true``) for AR stages,
``/v1/images/generations`` for diffusion stages, ``/v1/models``, ``/health``. Requests go
through the same :meth:`Worker.generate` as gRPC: held while an OnDemand stage sleeps, 503
with ``Retry-After`` past the hold timeout, 429 when the hold queue is full, 409 for a Manual
stage that is not Active. Errors use the OpenAI error shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from omnistage.worker.v1 import inference_service_pb2, types_pb2
from omnistage_worker.control.demand import retry_after_header
from omnistage_worker.control.queued import UNSERVED_HEADER, ShuttingDown
from omnistage_worker.control.transitions import Refused
from omnistage_worker.serving import openai_answers, openai_api
from omnistage_worker.serving.asgi_serve import InLoopServer
from omnistage_worker.serving.http_auth import BearerAuth
from omnistage_worker.serving.image_usage import image_usage
from omnistage_worker.serving.metrics_serve import HttpRequestCounter
from omnistage_worker.serving.openai_api import BadRequest, Parsed
from omnistage_worker.serving.openai_stream import ChunkQueue, sse_events
from omnistage_worker.state import Worker

log = logging.getLogger(__name__)

Parser = Callable[[Any, str], Parsed]
Response_ = inference_service_pb2.GenerateResponse

KEEP_ALIVE_S = 75

# How long the request was held (asleep or waking stage) before it was served, in ms.
HELD_HEADER = "x-omnistage-held-ms"
# The status logged for a request whose client went away before its answer (nginx's).
CLIENT_GONE = 499


class _Admission:
    """When a request arrived and when it was admitted (past holding)."""

    def __init__(self) -> None:
        self.arrived = time.monotonic()
        self.event = asyncio.Event()
        self.at = self.arrived

    def admitted(self) -> None:
        if not self.event.is_set():
            self.at = time.monotonic()
            self.event.set()

    @property
    def header(self) -> dict[str, str]:
        return {HELD_HEADER: f"{(self.at - self.arrived) * 1000:.1f}"}


def _error(
    status: int,
    body: dict[str, Any],
    retry_after: float | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    headers = dict(headers or {})
    if retry_after is not None:
        headers["Retry-After"] = retry_after_header(retry_after)
    return JSONResponse(body, status_code=status, headers=headers or None)


def refusal_response(exc: Refused, parsed: Parsed | None = None) -> JSONResponse:
    """A worker refusal in the OpenAI error shape: its HTTP status, ``Retry-After``, and
    ``x-omnistage-unserved`` when the request never reached a model (a router retries it)."""
    params = parsed.param if parsed is not None else str
    status, body = openai_api.refusal_status(exc.code, exc.message, params)
    unserved = {UNSERVED_HEADER: "shutting-down"} if isinstance(exc, ShuttingDown) else None
    return _error(status, body, exc.retry_after, unserved)


def _failed(request_id: str, exc: Exception) -> JSONResponse:
    log.exception("request %s failed", request_id)
    message = f"generation failed: {exc}"
    return _error(500, openai_api.error_body(message, "server_error", None, "internal_error"))


def _bad(exc: BadRequest) -> JSONResponse:
    return _error(
        exc.status, openai_api.error_body(exc.message, "invalid_request_error", exc.param, exc.code)
    )


class _Call:
    """One HTTP request: its parsed body once known (to name fields in refusals)."""

    parsed: Parsed | None = None


async def _until_disconnect(request: Request) -> None:
    """Return once the client has gone (the body must have been read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


Answer = Callable[[_Call, Any], Awaitable[Response]]


async def _answered(request: Request, limit: int, what: str, answer: Answer) -> Response:
    """``answer(call, body)``, or the OpenAI-shaped error for a bad request, a refusal or a
    failure; the body is read first (up to ``limit`` bytes).

    A client that goes away before its answer cancels it: a held request leaves the hold
    queue, a queued one leaves the model's queue (neither counts as demand any more).
    """
    try:
        body = await _json(request, limit)
    except BadRequest as exc:
        return _bad(exc)
    call = _Call()
    task = asyncio.ensure_future(answer(call, body))
    gone = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()  # the server gave up on this request: so does the worker
        raise
    finally:
        gone.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        log.info("%s: the client went away before its answer", what)
        return Response(status_code=CLIENT_GONE)
    try:
        return task.result()
    except BadRequest as exc:
        return _bad(exc)
    except Refused as exc:
        return refusal_response(exc, call.parsed)
    except Exception as exc:
        return _failed(what, exc)


async def _all(
    calls: list[asyncio.Future[Response_]],
) -> list[Response_]:
    """Every call's response; the first failure cancels the others and is raised."""
    try:
        return list(await asyncio.gather(*calls))
    finally:
        for call in calls:
            call.cancel()


class OpenAIApp:
    """The routes over one worker (behind the bearer check when a token is set)."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.model = worker.config.model_name
        self.limits = worker.config.limits
        self.created = int(time.time())
        self.app = Starlette(
            routes=[
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/images/generations", self.images, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
            ],
            exception_handlers={404: self._not_found, 405: self._not_allowed},
        )
        token = worker.config.http_token
        self.asgi: Any = BearerAuth(self.app, token) if token else self.app

    @property
    def is_ar(self) -> bool:
        return self.worker.runner.runner_kind == types_pb2.RUNNER_AR

    async def _not_found(self, request: Request, exc: Exception) -> Response:
        message = f"no route {request.method} {request.url.path}"
        return _error(404, openai_api.error_body(message, "invalid_request_error", None, None))

    async def _not_allowed(self, request: Request, exc: Exception) -> Response:
        message = f"{request.method} is not allowed on {request.url.path}"
        return _error(405, openai_api.error_body(message, "invalid_request_error", None, None))

    async def models(self, request: Request) -> Response:
        return JSONResponse(openai_answers.models_body(self.model, self.created))

    async def health(self, request: Request) -> Response:
        """200 while the worker can serve or be woken; 503 while loading, failed or going."""
        state = self.worker.state
        ok = state not in (types_pb2.WORKER_STATE_LOADING, types_pb2.WORKER_STATE_FAILED)
        ok = ok and not self.worker.terminating
        body = {
            "status": "ok" if ok else "unavailable",
            "state": types_pb2.WorkerState.Name(state),
            "activation": self.worker.demand.policy,
            "held_requests": self.worker.demand.held,
            "queued_requests": len(self.worker.queued),
            "shutting_down": self.worker.terminating,
        }
        return JSONResponse(body, status_code=200 if ok else 503)

    async def completions(self, request: Request) -> Response:
        return await self._text(request, openai_api.parse_completion, chat=False)

    async def chat(self, request: Request) -> Response:
        template = _chat_template(self.worker.runner)

        def parse(body: Any, served: str) -> Parsed:
            return openai_api.parse_chat(body, served, template)

        return await self._text(request, parse, chat=True)

    def _start(
        self, parsed: Parsed, admission: _Admission, sinks: list[Any] | None = None
    ) -> list[asyncio.Future[Response_]]:
        """The parsed requests, started at once: they run concurrently, so the engine
        serves them together as it does concurrent clients."""
        if parsed.user is not None:
            log.info("request %s: user %r", parsed.request.request_id, parsed.user)
        return [
            asyncio.ensure_future(
                self.worker.generate(
                    r,
                    on_text_chunk=sinks[i] if sinks is not None else None,
                    on_admitted=admission.admitted,
                )
            )
            for i, r in enumerate(parsed.requests)
        ]

    async def images(self, request: Request) -> Response:
        if self.is_ar:
            return _bad(BadRequest(None, "this stage serves text: use /v1/completions"))
        admission = _Admission()

        async def answer(call: _Call, body: Any) -> Response:
            parsed = call.parsed = openai_api.parse_image(body, self.model)
            responses = await _all(self._start(parsed, admission))
            usage = image_usage(self.worker.runner, parsed.request, len(responses))
            body = openai_answers.image_body(responses, usage)
            return JSONResponse(body, headers=admission.header)

        return await _answered(request, self.limits.request_body_bytes, "image", answer)

    async def _text(self, request: Request, parse: Parser, chat: bool) -> Response:
        if not self.is_ar:
            return _bad(BadRequest(None, "this stage serves images: use /v1/images/generations"))
        admission = _Admission()

        async def answer(call: _Call, body: Any) -> Response:
            parsed = call.parsed = parse(body, self.model)
            if parsed.stream:
                return await self._stream(parsed, chat, admission)
            responses = await _all(self._start(parsed, admission))
            answer = openai_answers.completion_body(parsed, responses, self.model, chat)
            return JSONResponse(answer, headers=admission.header)

        return await _answered(request, self.limits.request_body_bytes, "completion", answer)

    async def _stream(self, parsed: Parsed, chat: bool, admission: _Admission) -> Response:
        """Wait until the model produced the first chunk (held and queued first), then
        stream SSE.

        A refusal until then (a hold timeout, a shutdown that answers the queue) is an ordinary
        error response (status and Retry-After); after the first byte, a failure ends the
        stream with an error event.
        """
        events = ChunkQueue(len(parsed.requests))
        tasks = self._start(parsed, admission, events.sinks())
        for task in tasks:
            task.add_done_callback(lambda _: events.wake.set())
        waiter = asyncio.ensure_future(events.wake.wait())
        try:
            either: set[asyncio.Future[Any]] = {*tasks, waiter}
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            failed = next((t for t in tasks if t.done() and t.exception() is not None), None)
            if failed is not None:
                await _all(tasks)  # cancels the others, raises the failure
        except BaseException:
            for task in tasks:
                task.cancel()
            raise
        finally:
            waiter.cancel()
        return StreamingResponse(
            sse_events(parsed, self.model, chat, tasks, events),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", **admission.header},
        )


async def _json(request: Request, limit: int) -> Any:
    """The body as JSON; over ``limit`` bytes it is refused with 413 unread.

    413 rather than 400: the body is refused before it is parsed, so there is no field to
    name; 413 says the size is the fault, and that sending the same body again cannot help
    (the ``openai`` client does not retry it, a proxy knows it at once).
    """
    too_large = BadRequest(
        None,
        f"the request body is larger than this stage's limit of {limit} bytes",
        413,
        "request_too_large",
    )
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    raw = bytearray()
    async for chunk in request.stream():
        raw.extend(chunk)
        if len(raw) > limit:
            raise too_large
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(None, f"the request body is not JSON: {exc}") from exc


def _chat_template(runner: Any) -> openai_api.ChatTemplate:
    """The tokenizer's chat template when the model has one (else the plain rendering)."""
    tokenizer = getattr(runner, "tokenizer", None)
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return None

    def render(messages: list[dict[str, Any]]) -> str:
        text: str = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        return text

    return render


class HttpServer(InLoopServer):
    """Runs :class:`OpenAIApp` on ``host:port`` in the current event loop."""

    def __init__(
        self, worker: Worker, host: str, port: int, grace: float = 30.0, app: Any = None
    ) -> None:
        # ``app``: an engine's own API behind the worker's front (vLLM); else the worker's own.
        app = OpenAIApp(worker).asgi if app is None else app
        app = HttpRequestCounter(app, worker.metrics)
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            lifespan="off",
            access_log=False,
            timeout_graceful_shutdown=max(1, round(grace)),
            # Longer than clients' idle keep-alive (httpx: 5 s), so a client never sends on a
            # connection the server is closing (a request lost to that race is never served).
            timeout_keep_alive=KEEP_ALIVE_S,
        )
        super().__init__(config, "HTTP")
