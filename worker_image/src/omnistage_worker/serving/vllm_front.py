"""The thin ASGI front of a vLLM stage's HTTP API: the worker's gate before vLLM's own app.

vLLM's OpenAI app (built by :mod:`.runners.vllm_serve`) serves every request; this front
decides only whether and when a request may reach it:

- routes that run the engine (every route but the read-only ones in :data:`PASS_THROUGH`)
  go through :meth:`Worker.admit`: held while an OnDemand stage sleeps or wakes, refused
  (409 for a Manual stage not Active, 503 past the hold timeout or while loading, 429 when the
  hold queue is full) in the OpenAI error shape, and counted in flight from admission until the
  response's last byte, so a sleep drains them first and none ever reaches a sleeping engine;
- vLLM's own sleep, wake, pause and weight routes (registered with ``VLLM_SERVER_DEV_MODE``)
  are refused (403): the gRPC SleepService is the only authority over the engine's memory;
- ``/health`` is the worker's (its state, activation and held requests), as for every stage;
- a completion or chat body with a field vLLM's request model does not define (vLLM would
  serve it without the field) is refused with 400 naming it, before it is held
  (:mod:`.vllm_fields`).

A client that disconnects while held leaves the hold queue (its task is cancelled).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any

from starlette.responses import JSONResponse, Response

from omnistage.worker.v1 import types_pb2
from omnistage_worker.control.transitions import Refused
from omnistage_worker.serving import openai_api
from omnistage_worker.serving.openai_http import refusal_response
from omnistage_worker.serving.vllm_fields import CHECKED_ROUTES, refusal, unknown_field

if TYPE_CHECKING:
    from omnistage_worker.state import Worker

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: Read-only routes that never run the engine: served whatever the stage's state.
PASS_THROUGH = frozenset(
    {"/v1/models", "/version", "/metrics", "/tokenize", "/detokenize", "/load", "/ping"}
)
#: vLLM's routes that change the engine's memory or scheduling behind the worker's back.
REFUSED = frozenset(
    {
        "/sleep",
        "/wake_up",
        "/is_sleeping",
        "/pause",
        "/resume",
        "/is_paused",
        "/collective_rpc",
        "/reset_prefix_cache",
        "/reset_mm_cache",
        "/scale_elastic_ep",
        "/update_weights",
        "/init_weight_transfer_engine",
        "/start_weight_update",
        "/finish_weight_update",
    }
)


Fields = Callable[[], Mapping[str, frozenset[str]]]


class VllmFront:
    """ASGI app: the worker's gate, then vLLM's app (``app()``: None until the engine is up;
    ``fields()``: per checked route, the fields vLLM defines, empty until then)."""

    def __init__(
        self, worker: Worker, app: Callable[[], ASGIApp | None], fields: Fields = dict
    ) -> None:
        self.worker = worker
        self._app = app
        self._fields = fields

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            app = self._app()
            if app is not None:
                await app(scope, receive, send)
            return
        path = str(scope.get("path", ""))
        if path == "/health":
            await self._health()(scope, receive, send)
            return
        if path in REFUSED:
            message = f"{path} is the worker's: sleep and wake a stage through its SleepService"
            body = openai_api.error_body(message, "invalid_request_error", None, None)
            await JSONResponse(body, status_code=403)(scope, receive, send)
            return
        if path in PASS_THROUGH:
            await self._forward(scope, receive, send)
            return
        buffered: list[Message] = []
        accepted = self._fields().get(path) if path in CHECKED_ROUTES else None
        if accepted is not None:
            try:
                buffered = await _read_body(receive)
            except _Disconnected:
                return
            field = unknown_field(b"".join(m.get("body", b"") for m in buffered), accepted)
            if field is not None:
                await JSONResponse(refusal(field, path), status_code=400)(scope, receive, send)
                return
        try:
            replay = await self._admit(receive, buffered)
        except Refused as exc:
            await refusal_response(exc)(scope, receive, send)
            return
        except _Disconnected:
            return  # it left the hold queue; nobody to answer
        try:
            await self._forward(scope, replay, send)
        finally:
            self.worker.finished()

    async def _admit(self, receive: Receive, buffered: list[Message]) -> Receive:
        """Wait for admission, reading the body meanwhile (after the ``buffered`` messages
        already read); the body's replay for vLLM's app.

        A client that disconnects while held is noticed (``http.disconnect``) and its hold
        is cancelled, so it no longer keeps a wake asked for.
        """
        if self.worker.state == types_pb2.WORKER_STATE_ACTIVE:
            await self.worker.admit()  # nothing to hold: admitted at once
            return _Replay(buffered, receive) if buffered else receive
        admit = asyncio.ensure_future(self.worker.admit())
        reading: asyncio.Future[Any] | None = None
        try:
            while not admit.done():
                if reading is None:
                    reading = asyncio.ensure_future(receive())
                await asyncio.wait({admit, reading}, return_when=asyncio.FIRST_COMPLETED)
                if reading.done():
                    message = reading.result()
                    reading = None
                    if message["type"] == "http.disconnect":
                        raise _Disconnected
                    buffered.append(message)
            admit.result()
        except BaseException:
            admit.cancel()
            if admit.done() and not admit.cancelled() and admit.exception() is None:
                self.worker.finished()  # admitted in the same instant: not in flight after all
            raise
        finally:
            if reading is not None and not reading.done():
                reading.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reading
        if reading is not None and reading.done() and not reading.cancelled():
            buffered.append(reading.result())  # read in the instant admission came
        return _Replay(buffered, receive)

    async def _forward(self, scope: Scope, receive: Receive, send: Send) -> None:
        app = self._app()
        if app is None:
            message = (
                "worker is loading the model"
                if self.worker.state == types_pb2.WORKER_STATE_LOADING
                else "vLLM's engine has not started: this pre-warmed stage starts it at its "
                "first wake"
            )
            body = openai_api.error_body(message, "server_error", None, None)
            await JSONResponse(body, status_code=503)(scope, receive, send)
            return
        await app(scope, receive, send)

    def _health(self) -> Response:
        state = self.worker.state
        ok = state not in (types_pb2.WORKER_STATE_LOADING, types_pb2.WORKER_STATE_FAILED)
        body = {
            "status": "ok" if ok else "unavailable",
            "state": types_pb2.WorkerState.Name(state),
            "activation": self.worker.demand.policy,
            "held_requests": self.worker.demand.held,
            "inflight_requests": self.worker.inflight,
        }
        return JSONResponse(body, status_code=200 if ok else 503)


async def _read_body(receive: Receive) -> list[Message]:
    """Every message of the request's body (to its last ``more_body: False``)."""
    messages: list[Message] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _Disconnected
        messages.append(message)
        if not message.get("more_body", False):
            return messages


class _Disconnected(Exception):
    """The client went away while its request was held."""


class _Replay:
    """An ASGI ``receive`` that first gives back the messages read while held."""

    def __init__(self, buffered: list[Message], receive: Receive) -> None:
        self._buffered = buffered
        self._receive = receive

    async def __call__(self) -> Message:
        if self._buffered:
            return self._buffered.pop(0)
        return await self._receive()
