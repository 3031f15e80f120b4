"""The operator's HTTP transport to the API server: httpx's, with a cheaper idle check.

httpcore's pool checks every kept connection each time a request starts or ends (``has_expired``:
is an idle socket readable, i.e. closed by the server?). Over anyio each check rebuilt the TLS
stream's whole attribute table, a ``getpeername`` system call included, to find the socket: with
32 connections kept, a fifth of the operator's CPU in a 200-stage hand-over storm (py-spy). The
streams here find their socket once; the check itself (a zero-timeout poll) is httpcore's.
"""

# ruff: noqa: ASYNC109  (the ``timeout`` parameters are httpcore's stream and backend interface)
from __future__ import annotations

import select
import socket
import ssl
from collections.abc import Iterable
from typing import Any

import httpcore
import httpx

__all__ = ["transport"]


def _readable(sock: socket.socket | None) -> bool:
    """What httpcore's ``is_socket_readable`` answers: data or EOF waiting (a closed fd: True)."""
    if sock is None:
        return False
    fd = sock.fileno()
    if fd == -1:
        return True
    poll = select.poll()
    poll.register(fd, select.POLLIN)
    return bool(poll.poll(0))


class _Stream(httpcore.AsyncNetworkStream):
    """An httpcore stream that looks its socket up once."""

    def __init__(self, inner: httpcore.AsyncNetworkStream) -> None:
        self._inner = inner
        self._socket: socket.socket | None = inner.get_extra_info("socket")

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return await self._inner.read(max_bytes, timeout)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        await self._inner.write(buffer, timeout)

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.AsyncNetworkStream:
        return _Stream(await self._inner.start_tls(ssl_context, server_hostname, timeout))

    def get_extra_info(self, info: str) -> Any:
        if info == "is_readable":
            return _readable(self._socket)
        if info == "socket":
            return self._socket
        return self._inner.get_extra_info(info)


class _Backend(httpcore.AsyncNetworkBackend):
    """anyio's backend (httpcore's under asyncio), its streams wrapped in ``_Stream``."""

    def __init__(self) -> None:
        self._inner = httpcore.AnyIOBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        stream = await self._inner.connect_tcp(host, port, timeout, local_address, socket_options)
        return _Stream(stream)

    async def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[Any] | None = None
    ) -> httpcore.AsyncNetworkStream:
        return _Stream(await self._inner.connect_unix_socket(path, timeout, socket_options))

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


def transport(verify: ssl.SSLContext | bool, limits: httpx.Limits) -> httpx.AsyncHTTPTransport:
    """httpx's transport whose connections are ``_Stream``s (httpx builds its pool without a
    backend argument: the pool's backend is set after)."""
    out = httpx.AsyncHTTPTransport(verify=verify, limits=limits)
    pool = out._pool
    if not isinstance(pool, httpcore.AsyncConnectionPool) or not hasattr(pool, "_network_backend"):
        raise TypeError(f"httpx's transport holds {type(pool).__name__}: no backend to set")
    pool._network_backend = _Backend()
    return out
