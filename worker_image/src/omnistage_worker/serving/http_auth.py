"""An optional bearer token for the OpenAI HTTP API (worker and router); ``/health`` stays open.

An ASGI middleware: without ``Authorization: Bearer <token>`` a request is answered 401 in the
OpenAI error shape (the ``openai`` client raises ``AuthenticationError``), before its body is
read. The token comes from a file (``--http-token-file``; the operator mounts the Secret named
in ``spec.http.authSecret``).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from omnistage_worker.serving.auth import token_matches
from omnistage_worker.serving.openai_api import error_body

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = frozenset({"/health"})
_MESSAGE = "this API needs 'Authorization: Bearer <token>' with the stage's API token"


class BearerAuth:
    """Wraps an ASGI app: HTTP requests outside :data:`OPEN_PATHS` need the token."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self._token = token

    def __repr__(self) -> str:  # never show the token
        return "BearerAuth()"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or ())
        if token_matches(headers.get(b"authorization"), self._token):
            await self.app(scope, receive, send)
            return
        body = json.dumps(
            error_body(_MESSAGE, "invalid_request_error", None, "invalid_api_key")
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
