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


def bearer_of(header: str | bytes | None) -> str | None:
    """The token of an ``authorization: Bearer <token>`` value, or None."""
    if header is None:
        return None
    text = header.decode("utf-8", "replace") if isinstance(header, bytes) else header
    scheme, _, given = text.strip().partition(" ")
    return given.strip() or None if scheme.lower() == "bearer" else None


def token_matches(header: str | bytes | None, token: str) -> bool:
    """Whether an ``authorization`` value is ``Bearer <token>`` (constant-time compare)."""
    given = bearer_of(header)
    return given is not None and hmac.compare_digest(given.encode(), token.encode())


_DENIED = "this method needs 'authorization: Bearer <token>' metadata with the worker's token"


def _deny_handler(method: str, reason: str) -> grpc.RpcMethodHandler:
    """Aborts UNAUTHENTICATED with ``reason``; a stream handler for a streaming ``method``."""

    async def deny(request: Any, context: Any) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

    async def deny_stream(request: Any, context: Any) -> AsyncIterator[Any]:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)
        yield None  # pragma: no cover - abort raises

    if method.startswith(STREAMING_PREFIXES):
        return grpc.unary_stream_rpc_method_handler(deny_stream)
    return grpc.unary_unary_rpc_method_handler(deny)


class ProtectedMethodsInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Refuses protected methods (UNAUTHENTICATED) when :meth:`refusal` gives a reason."""

    def __init__(self, prefixes: tuple[str, ...] = PROTECTED_PREFIXES) -> None:
        self._prefixes = prefixes

    async def refusal(self, header: str | bytes | None) -> str | None:
        """Why a call with this ``authorization`` value is refused; None to let it through."""
        raise NotImplementedError

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
        reason = await self.refusal(header)
        if reason is None:
            return await continuation(handler_call_details)
        return _deny_handler(method, reason)


class BearerTokenInterceptor(ProtectedMethodsInterceptor):
    """Refuses protected methods without the right bearer token (UNAUTHENTICATED)."""

    def __init__(self, token: str, prefixes: tuple[str, ...] = PROTECTED_PREFIXES) -> None:
        super().__init__(prefixes)
        self._token = token

    def __repr__(self) -> str:  # never show the token
        return f"BearerTokenInterceptor(prefixes={self._prefixes!r})"

    async def refusal(self, header: str | bytes | None) -> str | None:
        return None if token_matches(header, self._token) else _DENIED
