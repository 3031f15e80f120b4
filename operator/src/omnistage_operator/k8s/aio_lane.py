"""The operator's API requests over aiohttp (``AioLane``), with kr8s's credentials.

kr8s speaks through httpx, whose client and transport layers (request building, auth and
redirect hooks, httpcore's pool, h11, anyio's TLS stream) cost the operator more CPU per request
than the request's own work: the request path was the largest part of its event-loop time in a
400-stage hand-over storm (cProfile: about 40%, status PATCHes and Event POSTs). kopf, which
the operator runs on, already talks to the API server through aiohttp. The lane sends the same
requests with the credentials kr8s built (its server, its TLS context with any client
certificate, its ``Authorization`` header, its SNI name), rebuilt whenever kr8s rebuilds its own
client (``kube.keep_connections``: after a re-authentication). It answers with the status and
the raw body; ``kube.Kube`` turns those into its own results, and sends a request the lane
cannot answer (a connection error, 401/403: expired credentials) through kr8s, which
re-authenticates. Not used through a proxy (httpx honours the environment's; aiohttp here
does not).
"""

from __future__ import annotations

import json
import ssl
from collections.abc import Mapping
from typing import Any

import aiohttp

__all__ = ["AioLane", "LaneFailed", "error_message", "lane_args"]


class LaneFailed(Exception):
    """The lane could not answer (connection error, credentials refused): use kr8s."""


class AioLane:
    """One aiohttp session to the API server, ``limit`` connections kept for ``keep_s``."""

    def __init__(
        self,
        server: str,
        headers: Mapping[str, str],
        verify: ssl.SSLContext | bool,
        *,
        server_hostname: str | None = None,
        limit: int = 32,
        keep_s: float = 300.0,
        read_timeout_s: float | None = None,
        connect_timeout_s: float | None = None,
    ) -> None:
        self.server = server.rstrip("/")
        self._headers = dict(headers)
        self._ssl: ssl.SSLContext | bool = verify
        self._server_hostname = server_hostname
        self._limit, self._keep_s = limit, keep_s
        self._timeout = aiohttp.ClientTimeout(
            total=None, sock_read=read_timeout_s, sock_connect=connect_timeout_s
        )
        self._session: aiohttp.ClientSession | None = None
        self.opened = 0  # connections opened (each a TCP connect and TLS handshake)

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(
                limit=self._limit, keepalive_timeout=self._keep_s, ssl=self._ssl
            )
            trace = aiohttp.TraceConfig()
            trace.on_connection_create_end.append(self._opened)
            self._session = aiohttp.ClientSession(
                headers=self._headers, connector=connector, timeout=self._timeout,
                auto_decompress=False, trace_configs=[trace],
            )  # fmt: skip
        return self._session

    async def _opened(self, *_: Any) -> None:
        self.opened += 1

    async def request(
        self,
        method: str,
        path: str,
        *,
        content: str | bytes | None = None,
        headers: Mapping[str, str] | None = None,
        params: Mapping[str, str] | None = None,
        read: bool = True,
    ) -> tuple[int, bytes]:
        """``method`` on ``path`` (the URL after the server); the status and the body (read
        whole either way: aiohttp closes a connection whose answer was left unread; returned
        empty unless ``read`` or the status is an error). Raises ``LaneFailed`` when it could
        not be answered, or the credentials were refused (401, 403)."""
        session = self._open()
        extra: dict[str, Any] = {}
        if self._server_hostname:
            extra["server_hostname"] = self._server_hostname
        try:
            async with session.request(
                method, self.server + path, data=content, headers=headers, params=params,
                allow_redirects=False, **extra,
            ) as resp:  # fmt: skip
                status = resp.status
                if status in (401, 403):
                    raise LaneFailed(f"HTTP {status}")
                body = await resp.read()
                if not read and status < 400:
                    body = b""
        except aiohttp.ClientError as exc:
            raise LaneFailed(str(exc) or type(exc).__name__) from exc
        return status, body

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def lane_args(request: Mapping[str, Any]) -> dict[str, Any]:
    """kr8s's (httpx's) request arguments (``json``, ``content``, ``headers``, ``params``) as
    the lane's: a ``json`` body serialized, with its content type."""
    out: dict[str, Any] = {k: request[k] for k in ("content", "params") if k in request}
    headers = dict(request.get("headers") or {})
    if "json" in request:
        out["content"] = json.dumps(request["json"])
        headers.setdefault("Content-Type", "application/json")
    if headers:
        out["headers"] = headers
    unknown = set(request) - {"json", "content", "headers", "params"}
    if unknown:
        raise TypeError(f"not a lane request: {sorted(unknown)}")
    return out


def error_message(raw: bytes) -> str:
    """The API server's ``Status`` message of an error answer (its text when not JSON)."""
    try:
        status = json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")[:500]
    if isinstance(status, Mapping) and "message" in status:
        return str(status["message"])
    return raw.decode(errors="replace")[:500]
