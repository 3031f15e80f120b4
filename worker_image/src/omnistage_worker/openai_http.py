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
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from omnistage.worker.v1 import inference_service_pb2, types_pb2
from omnistage_worker import openai_api
from omnistage_worker.demand import retry_after_header
from omnistage_worker.openai_api import BadRequest, Parsed
from omnistage_worker.state import Worker
from omnistage_worker.transitions import Refused

log = logging.getLogger(__name__)

Parser = Callable[[Any, str], Parsed]


KEEP_ALIVE_S = 75

# How long the request was held (asleep or waking stage) before it was served, in ms.
HELD_HEADER = "x-omnistage-held-ms"


class _Admission:
    """When a request arrived and when it was admitted (past holding)."""

    def __init__(self) -> None:
        self.arrived = time.monotonic()
        self.event = asyncio.Event()
        self.at = self.arrived

    def admitted(self) -> None:
        self.at = time.monotonic()
        self.event.set()

    @property
    def header(self) -> dict[str, str]:
        return {HELD_HEADER: f"{(self.at - self.arrived) * 1000:.1f}"}


def _error(status: int, body: dict[str, Any], retry_after: float | None = None) -> JSONResponse:
    headers = {"Retry-After": retry_after_header(retry_after)} if retry_after is not None else None
    return JSONResponse(body, status_code=status, headers=headers)


def _refused(exc: Refused) -> JSONResponse:
    status, body = openai_api.refusal_status(exc.code, exc.message)
    return _error(status, body, exc.retry_after)


def _failed(request_id: str, exc: Exception) -> JSONResponse:
    log.exception("request %s failed", request_id)
    message = f"generation failed: {exc}"
    return _error(500, openai_api.error_body(message, "server_error", None, "internal_error"))


async def _answered(what: str, answer: Callable[[], Awaitable[Response]]) -> Response:
    """``answer()``, or the OpenAI-shaped error for a bad request, a refusal or a failure."""
    try:
        return await answer()
    except BadRequest as exc:
        return _bad(exc)
    except Refused as exc:
        return _refused(exc)
    except Exception as exc:
        return _failed(what, exc)


def _bad(exc: BadRequest) -> JSONResponse:
    kind = "invalid_request_error"
    code = "model_not_found" if exc.status == 404 else "invalid_value"
    return _error(exc.status, openai_api.error_body(exc.message, kind, exc.param, code))


def _sse(body: dict[str, Any] | str) -> bytes:
    data = body if isinstance(body, str) else json.dumps(body, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class OpenAIApp:
    """The routes over one worker."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.model = worker.config.model_name
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
        return JSONResponse(openai_api.models_body(self.model, self.created))

    async def health(self, request: Request) -> Response:
        """200 while the worker can serve or be woken; 503 while loading or failed."""
        state = self.worker.state
        ok = state not in (types_pb2.WORKER_STATE_LOADING, types_pb2.WORKER_STATE_FAILED)
        body = {
            "status": "ok" if ok else "unavailable",
            "state": types_pb2.WorkerState.Name(state),
            "activation": self.worker.demand.policy,
            "held_requests": self.worker.demand.held,
        }
        return JSONResponse(body, status_code=200 if ok else 503)

    async def completions(self, request: Request) -> Response:
        return await self._text(request, openai_api.parse_completion, chat=False)

    async def chat(self, request: Request) -> Response:
        template = _chat_template(self.worker.runner)

        def parse(body: Any, served: str) -> Parsed:
            return openai_api.parse_chat(body, served, template)

        return await self._text(request, parse, chat=True)

    async def images(self, request: Request) -> Response:
        if self.is_ar:
            return _bad(BadRequest(None, "this stage serves text: use /v1/completions"))
        admission = _Admission()

        async def answer() -> Response:
            parsed = openai_api.parse_image(await _json(request), self.model)
            response = await self.worker.generate(parsed.request, on_admitted=admission.admitted)
            return JSONResponse(openai_api.image_body(response), headers=admission.header)

        return await _answered("image", answer)

    async def _text(self, request: Request, parse: Parser, chat: bool) -> Response:
        if not self.is_ar:
            return _bad(BadRequest(None, "this stage serves images: use /v1/images/generations"))
        admission = _Admission()

        async def answer() -> Response:
            parsed = parse(await _json(request), self.model)
            if parsed.stream:
                return await self._stream(parsed, chat, admission)
            response = await self.worker.generate(parsed.request, on_admitted=admission.admitted)
            body = openai_api.completion_body(parsed, response, self.model, chat)
            return JSONResponse(body, headers=admission.header)

        return await _answered("completion", answer)

    async def _stream(self, parsed: Parsed, chat: bool, admission: _Admission) -> Response:
        """Wait until the request is admitted (held first when asleep), then stream SSE.

        A refusal before admission is an ordinary error response (status and Retry-After);
        after the first byte, a failure ends the stream with an error event.
        """
        chunks: asyncio.Queue[tuple[list[int], str]] = asyncio.Queue()
        task = asyncio.ensure_future(
            self.worker.generate(
                parsed.request,
                on_chunk=lambda ids, text: chunks.put_nowait((ids, text)),
                on_admitted=admission.admitted,
            )
        )
        waiter: asyncio.Future[Any] = asyncio.ensure_future(admission.event.wait())
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        failure = task.exception() if task.done() else None
        if failure is not None:
            raise failure
        return StreamingResponse(
            self._events(parsed, chat, task, chunks),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", **admission.header},
        )

    async def _events(
        self,
        parsed: Parsed,
        chat: bool,
        task: asyncio.Future[inference_service_pb2.GenerateResponse],
        chunks: asyncio.Queue[tuple[list[int], str]],
    ) -> AsyncIterator[bytes]:
        tokens, first = 0, True
        try:
            while not task.done() or not chunks.empty():
                getter = asyncio.ensure_future(chunks.get())
                either: set[asyncio.Future[Any]] = {getter, task}
                await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    continue
                ids, text = getter.result()
                tokens += len(ids)
                if text or first:
                    yield _sse(openai_api.chunk_body(parsed, self.model, chat, text, first))
                    first = False
            task.result()
        except Exception as exc:
            log.exception("streamed request %s failed", parsed.request.request_id)
            yield _sse(openai_api.error_body(f"generation failed: {exc}", "server_error"))
            return
        yield _sse(openai_api.final_chunk_body(parsed, self.model, chat, tokens))
        yield _sse("[DONE]")


async def _json(request: Request) -> Any:
    try:
        return await request.json()
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


class _Server(uvicorn.Server):
    """uvicorn inside the worker's loop: the worker's own SIGTERM handling stays in charge."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpServer:
    """Runs :class:`OpenAIApp` on ``host:port`` in the current event loop."""

    def __init__(self, worker: Worker, host: str, port: int, grace: float = 30.0) -> None:
        # A runner whose engine serves its own API (vLLM) brings its app behind the worker's gate.
        front = getattr(worker.runner, "http_front", None)
        app = front(worker) if callable(front) else OpenAIApp(worker).app
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
        self._server = _Server(config)
        self._task: asyncio.Task[None] | None = None
        self.port = 0

    async def start(self) -> int:
        """Bind and serve; the bound port."""
        self._task = asyncio.ensure_future(self._server.serve())
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise RuntimeError("the HTTP server ended before it started")
            await asyncio.sleep(0.01)
        self.port = int(self._server.servers[0].sockets[0].getsockname()[1])
        return self.port

    async def stop(self) -> None:
        """Stop accepting, let open responses end, close."""
        if self._task is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
