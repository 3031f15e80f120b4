"""Bearer-token check for SleepService and DemandService (InferenceService, health and
reflection stay open).

Why Generate is open: the token guards what can take a GPU away from another stage (Sleep and
WakeUp); inference is the stage's product and is exposed through its own Service. A deployment
that wants Generate closed puts it behind a NetworkPolicy or a proxy.
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

PROTECTED_PREFIXES = (
    "/omnistage.worker.v1.SleepService/",
    "/omnistage.worker.v1.DemandService/",
)
# Methods whose answer is a stream: refused with a stream handler of the same shape.
STREAMING_PREFIXES = ("/omnistage.worker.v1.DemandService/",)


def token_matches(header: str | bytes | None, token: str) -> bool:
    """Whether an ``authorization`` value is ``Bearer <token>`` (constant-time compare)."""
    if header is None:
        return False
    text = header.decode("utf-8", "replace") if isinstance(header, bytes) else header
    scheme, _, given = text.strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(given.strip().encode(), token.encode())


_DENIED = "this method needs 'authorization: Bearer <token>' metadata with the worker's token"


async def _deny(request: Any, context: Any) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, _DENIED)


async def _deny_stream(request: Any, context: Any) -> AsyncIterator[Any]:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, _DENIED)
    yield None  # pragma: no cover - abort raises


_DENY = grpc.unary_unary_rpc_method_handler(_deny)
_DENY_STREAM = grpc.unary_stream_rpc_method_handler(_deny_stream)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Refuses protected methods without the right bearer token (UNAUTHENTICATED)."""

    def __init__(self, token: str, prefixes: tuple[str, ...] = PROTECTED_PREFIXES) -> None:
        self._token = token
        self._prefixes = prefixes

    def __repr__(self) -> str:  # never show the token
        return f"BearerTokenInterceptor(prefixes={self._prefixes!r})"

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method: str = handler_call_details.method
        if not method.startswith(self._prefixes):
            return await continuation(handler_call_details)
        metadata = handler_call_details.invocation_metadata or ()
        header = next((value for key, value in metadata if key == "authorization"), None)
        if token_matches(header, self._token):
            return await continuation(handler_call_details)
        return _DENY_STREAM if method.startswith(STREAMING_PREFIXES) else _DENY
