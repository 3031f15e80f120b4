"""The worker's ``/metrics`` endpoint and the request counting of its gRPC and HTTP servers.

The endpoint is uvicorn in the worker's event loop (as the OpenAI HTTP API is), so the scrape
reads the worker's state on the loop that changes it. Requests are counted by a gRPC server
interceptor and an ASGI wrapper: every answer, refusals and errors included, by route and
status. Routes are the registered gRPC methods and the known HTTP paths (any other path is
counted as ``other``, so a scanner cannot grow the label set).
"""

from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import uvicorn
from prometheus_client import CollectorRegistry, make_asgi_app

from omnistage_worker.metrics import WorkerMetrics
from omnistage_worker.serving.asgi_serve import InLoopServer

__all__ = ["GrpcRequestCounter", "HttpRequestCounter", "MetricsServer"]

HTTP_ROUTES = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/images/generations",
        "/v1/models",
        "/health",
    }
)
# Status of an HTTP request whose app ended without starting a response.
_NO_RESPONSE = "500"


class MetricsServer(InLoopServer):
    """Serves ``registry`` in the Prometheus text format on ``host:port`` (every path)."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        config = uvicorn.Config(
            make_asgi_app(registry),
            host=host,
            port=port,
            log_level="warning",
            lifespan="off",
            access_log=False,
        )
        super().__init__(config, "metrics")


class HttpRequestCounter:
    """ASGI wrapper counting every HTTP answer of ``app`` by path and status."""

    def __init__(self, app: Any, metrics: WorkerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        path = str(scope.get("path", ""))
        route = path if path in HTTP_ROUTES else "other"
        status = _NO_RESPONSE
        began = time.monotonic()

        async def sending(message: Any) -> None:
            nonlocal status
            if message.get("type") == "http.response.start":
                status = str(message.get("status", _NO_RESPONSE))
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            self.metrics.answered("http", route, status, time.monotonic() - began)


Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]]


class GrpcRequestCounter(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Counts every answer of the unary and server-streaming methods by method and code
    (outermost interceptor: a refusal by the bearer check is counted too)."""

    def __init__(self, metrics: WorkerMetrics) -> None:
        self.metrics = metrics

    async def intercept_service(
        self, continuation: Continuation, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return None
        route = str(details.method).lstrip("/")
        if handler.unary_unary is not None and inspect.iscoroutinefunction(handler.unary_unary):
            return grpc.unary_unary_rpc_method_handler(
                self._unary(route, handler.unary_unary),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None and inspect.isasyncgenfunction(handler.unary_stream):
            return grpc.unary_stream_rpc_method_handler(
                self._stream(route, handler.unary_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler

    def _unary(self, route: str, inner: Any) -> Any:
        async def unary(request: Any, context: Any) -> Any:
            began = time.monotonic()
            failed = True
            try:
                response = await inner(request, context)
                failed = False
                return response
            finally:
                self.metrics.answered("grpc", route, _code(context, failed), _since(began))

        return unary

    def _stream(self, route: str, inner: Any) -> Any:
        async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
            began = time.monotonic()
            failed = True
            try:
                async for message in inner(request, context):
                    yield message
                failed = False
            finally:
                self.metrics.answered("grpc", route, _code(context, failed), _since(began))

        return stream


def _since(began: float) -> float:
    return time.monotonic() - began


def _code(context: Any, failed: bool) -> str:
    """The call's status code name: the one set by ``abort``/``set_code``, else OK, or
    UNKNOWN for a call that ended by an exception without one (CANCELLED if the client left)."""
    code: Any = None
    with contextlib.suppress(Exception):
        code = context.code()
    if isinstance(code, grpc.StatusCode):
        return str(code.name)
    if isinstance(code, int):
        for status in grpc.StatusCode:
            if status.value[0] == code:
                return str(status.name)
    if not failed:
        return "OK"
    with contextlib.suppress(Exception):
        if context.cancelled():
            return "CANCELLED"
    return "UNKNOWN"
