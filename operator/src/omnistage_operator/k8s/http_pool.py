"""The operator's HTTP transport to the API server: httpx's, with a cheaper idle check and
pool bookkeeping.

httpcore's pool checks every kept connection each time a request starts or ends (``has_expired``:
is an idle socket readable, i.e. closed by the server?). Over anyio each check rebuilt the TLS
stream's whole attribute table, a ``getpeername`` system call included, to find the socket: with
32 connections kept, a fifth of the operator's CPU in a 200-stage hand-over storm (py-spy). The
streams here find their socket once; the check itself (a zero-timeout poll) is httpcore's.

The same pass (httpcore 1.0's ``_assign_requests_to_connections``) also counted the pool's
connections by listing every one's ``is_idle()`` once per idle connection: 32 x 32 calls each
time a request starts or ends, about 6% of the operator's CPU in that storm (py-spy at 34b9965).
``_Pool`` makes the same decisions in the same order (tests/unit/test_http_pool.py runs both over
the same pools) with one look at each connection.
"""

# ruff: noqa: ASYNC109  (the ``timeout`` parameters are httpcore's stream and backend interface)
from __future__ import annotations

import select
import socket
import ssl
import time
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


def _announces_body(buffer: bytes) -> bool:
    """Whether ``buffer`` is a request's head (httpcore writes it alone) whose body follows."""
    if not buffer.endswith(b"\r\n\r\n"):
        return False
    head = buffer.lower()
    if b"\r\ntransfer-encoding: chunked\r\n" in head:
        return True
    at = head.find(b"\r\ncontent-length:")
    if at < 0:
        return False
    value = head[at + 17 : head.find(b"\r\n", at + 2)].strip()
    return value.isdigit() and int(value) > 0


class _Stream(httpcore.AsyncNetworkStream):
    """An httpcore stream that looks its socket up once, and sends a request's head with its
    body: httpcore writes them one after the other, each its own TLS record and ``send``
    (about a tenth of the operator's CPU in a 200-stage hand-over storm went to those sends,
    py-spy at 08ccf33, half of them heads). A head that announces a body is held until the
    next write, and whatever is held goes out before any other write or read: the bytes and
    their order on the wire are the same."""

    def __init__(self, inner: httpcore.AsyncNetworkStream) -> None:
        self._inner = inner
        self._socket: socket.socket | None = inner.get_extra_info("socket")
        self._held = b""

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        if self._held:
            held, self._held = self._held, b""
            await self._inner.write(held, timeout)
        return await self._inner.read(max_bytes, timeout)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if self._held:
            buffer, self._held = self._held + buffer, b""
        elif _announces_body(buffer):
            self._held = buffer
            return
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


class _Pool(httpcore.AsyncConnectionPool):
    """httpcore's pool whose bookkeeping looks at each connection once (module docstring), and
    sweeps every kept connection for expiry at most every ``SWEEP_S``."""

    # httpcore's pass asks every connection ``has_expired`` each time a request starts or ends:
    # for an idle one a ``poll`` system call (is the socket readable: did the server close
    # it?). With 32 connections kept that was the pass's whole cost, a tenth of the
    # operator's event-loop time in a 400-stage hand-over storm (cProfile: 116288
    # ``has_expired`` calls for 1600 requests). Between sweeps only the connection a request
    # is about to take is asked (and dropped, the next one looked at, when it expired): no
    # request goes out on an expired connection, and an expired idle one nobody takes is
    # closed at the next sweep instead of at once.
    SWEEP_S = 1.0
    _swept_at = float("-inf")

    def _assign_requests_to_connections(self) -> list[httpcore.AsyncConnectionInterface]:
        """httpcore 1.0's pass, decision for decision when a sweep is due: drop closed
        connections, close expired ones and idle ones beyond the keep-alive limit, then give
        each queued request the first available connection to its origin, else a new one
        (below the limit), else one made in place of the first idle one."""
        closing: list[httpcore.AsyncConnectionInterface] = []
        connections = self._connections
        now = time.monotonic()
        sweep = now - self._swept_at >= self.SWEEP_S
        if sweep:
            self._swept_at = now
        for connection in list(connections):
            if connection.is_closed():
                connections.remove(connection)
            elif (sweep and connection.has_expired()) or (
                connection.is_idle() and len(connections) > self._max_keepalive_connections
            ):
                connections.remove(connection)
                closing.append(connection)
        for pool_request in [r for r in self._requests if r.is_queued()]:
            origin = pool_request.request.url.origin
            available = self._available(origin, closing, checked=sweep)
            if available is not None:
                pool_request.assign_to_connection(available)
                continue
            if len(connections) >= self._max_connections:
                idle = next((c for c in connections if c.is_idle()), None)
                if idle is None:
                    continue  # stays queued
                connections.remove(idle)
                closing.append(idle)
            connection = self.create_connection(origin)
            connections.append(connection)
            pool_request.assign_to_connection(connection)
        return closing

    def _available(
        self,
        origin: httpcore.Origin,
        closing: list[httpcore.AsyncConnectionInterface],
        *,
        checked: bool,
    ) -> httpcore.AsyncConnectionInterface | None:
        """The first available connection to ``origin``; unless this pass swept (``checked``),
        one that expired is closed and the next one looked at."""
        connections = self._connections
        for connection in list(connections):
            if not (connection.can_handle_request(origin) and connection.is_available()):
                continue
            if checked or not connection.has_expired():
                return connection
            connections.remove(connection)
            closing.append(connection)
        return None


def transport(verify: ssl.SSLContext | bool, limits: httpx.Limits) -> httpx.AsyncHTTPTransport:
    """httpx's transport whose pool is a ``_Pool`` and whose connections are ``_Stream``s
    (httpx builds its pool without a backend argument: the pool's backend is set after)."""
    out = httpx.AsyncHTTPTransport(verify=verify, limits=limits)
    pool = out._pool
    if type(pool) is not httpcore.AsyncConnectionPool or not hasattr(pool, "_network_backend"):
        raise TypeError(f"httpx's transport holds {type(pool).__name__}: no backend to set")
    pool.__class__ = _Pool  # the same object, its bookkeeping ours
    pool._network_backend = _Backend()
    return out
