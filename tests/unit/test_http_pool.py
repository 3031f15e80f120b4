"""The operator's HTTP transport finds each connection's socket once, still sees a connection
the server closed, and its pool decides as httpcore's own with one look at each connection
(``k8s.http_pool``)."""

from __future__ import annotations

import asyncio
import random
import socket
from typing import Any

import httpcore
import httpx
from httpcore._async.connection_pool import AsyncPoolRequest

from omnistage_operator.k8s import http_pool


class CountingStream(httpcore.AsyncNetworkStream):
    """A stream over one end of a socket pair that counts its attribute look-ups."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lookups = 0

    def get_extra_info(self, info: str) -> Any:
        self.lookups += 1
        return self.sock if info == "socket" else None


def test_the_socket_is_looked_up_once_and_readability_is_the_sockets() -> None:
    ours, theirs = socket.socketpair()
    try:
        inner = CountingStream(ours)
        stream = http_pool._Stream(inner)
        assert [stream.get_extra_info("is_readable") for _ in range(50)] == [False] * 50
        theirs.close()  # the server's side went away: EOF waits to be read
        assert stream.get_extra_info("is_readable") is True
        assert inner.lookups == 1
    finally:
        ours.close()


async def _serve_once_then_close(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    """Answer one request, then close the connection (as an API server may an idle one)."""
    while (await reader.readline()) not in (b"\r\n", b""):
        pass
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: text/plain\r\n\r\nok")
    await writer.drain()
    await asyncio.sleep(0.05)
    writer.close()


async def test_a_connection_the_server_closed_is_replaced() -> None:
    server = await asyncio.start_server(_serve_once_then_close, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    limits = httpx.Limits(max_connections=4, max_keepalive_connections=4, keepalive_expiry=60)
    transport = http_pool.transport(False, limits)
    async with server, httpx.AsyncClient(transport=transport) as client:
        first = await client.get(f"http://127.0.0.1:{port}/")
        assert first.text == "ok"
        conns = transport._pool.connections
        assert len(conns) == 1
        stream = conns[0]._connection._network_stream  # type: ignore[attr-defined]
        assert isinstance(stream, http_pool._Stream)
        for _ in range(100):  # the server closes it
            if stream.get_extra_info("is_readable"):
                break
            await asyncio.sleep(0.01)
        second = await client.get(f"http://127.0.0.1:{port}/")
        assert second.text == "ok"
        assert transport._pool.connections[0]._connection is not conns[0]._connection  # type: ignore[attr-defined]


class RecordingStream(httpcore.AsyncNetworkStream):
    """An inner stream that records each write and answers reads from ``answer``."""

    def __init__(self, answer: bytes = b"") -> None:
        self.writes: list[bytes] = []
        self.events: list[str] = []
        self.answer = answer

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:  # noqa: ASYNC109
        self.writes.append(buffer)
        self.events.append("write")

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:  # noqa: ASYNC109
        self.events.append("read")
        answer, self.answer = self.answer, b""
        return answer

    def get_extra_info(self, info: str) -> Any:
        return None


HEAD = b"PATCH /apis/x/status HTTP/1.1\r\nHost: api\r\nContent-Length: 7\r\n\r\n"


async def test_a_head_that_announces_a_body_goes_out_with_it() -> None:
    inner = RecordingStream()
    stream = http_pool._Stream(inner)
    await stream.write(HEAD)
    assert inner.writes == []
    await stream.write(b'{"a":1}')
    assert inner.writes == [HEAD + b'{"a":1}']  # one send, one TLS record
    await stream.write(b"")  # httpcore's end of a Content-Length body
    assert inner.writes[1:] in ([], [b""])


async def test_heads_without_a_body_and_bodies_go_out_at_once() -> None:
    inner = RecordingStream()
    stream = http_pool._Stream(inner)
    get = b"GET /api/v1/pods HTTP/1.1\r\nHost: api\r\n\r\n"
    empty = b"POST /x HTTP/1.1\r\nhost: api\r\ncontent-length: 0\r\n\r\n"
    for buffer in (get, empty, b"data ending in a blank line\r\n\r\n"):
        await stream.write(buffer)
    assert inner.writes == [get, empty, b"data ending in a blank line\r\n\r\n"]
    chunked = b"POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
    await stream.write(chunked)
    await stream.write(b"3\r\nabc\r\n")
    assert inner.writes[-1] == chunked + b"3\r\nabc\r\n"


async def test_what_is_held_goes_out_before_any_read() -> None:
    inner = RecordingStream(answer=b"HTTP/1.1 200 OK\r\n")
    stream = http_pool._Stream(inner)
    await stream.write(HEAD)
    assert await stream.read(100) == b"HTTP/1.1 200 OK\r\n"
    assert inner.events == ["write", "read"] and inner.writes == [HEAD]


async def _echo_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answer each request with its own body."""
    while True:
        length = 0
        while (line := await reader.readline()) not in (b"\r\n", b""):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        if not line:
            break
        body = await reader.readexactly(length)
        head = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body)
        writer.write(head + body)
        await writer.drain()
    writer.close()


async def test_requests_with_and_without_bodies_through_the_transport() -> None:
    server = await asyncio.start_server(_echo_body, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    limits = httpx.Limits(max_connections=2, max_keepalive_connections=2, keepalive_expiry=60)
    async with server, httpx.AsyncClient(transport=http_pool.transport(False, limits)) as client:
        url = f"http://127.0.0.1:{port}/x"
        for n in range(5):
            patch = {"status": {"state": "Asleep", "n": n}}
            answer = await client.patch(url, json=patch)
            assert answer.json() == patch
            assert (await client.get(url)).content == b""
            assert (await client.post(url, content=b"")).content == b""


class FakeConnection(httpcore.AsyncConnectionInterface):
    """A pooled connection in a given state; counts how often the pool looks at it."""

    def __init__(self, ident: str, origin: httpcore.Origin, state: str, expired: bool) -> None:
        self.ident, self.origin, self.state, self.expired = ident, origin, state, expired
        self.looks = 0
        self.expiry_looks = 0

    def _look(self) -> None:
        self.looks += 1

    def can_handle_request(self, origin: httpcore.Origin) -> bool:
        self._look()
        return origin == self.origin

    def is_available(self) -> bool:
        self._look()
        return self.state == "idle"

    def has_expired(self) -> bool:
        self._look()
        self.expiry_looks += 1
        return self.expired

    def is_idle(self) -> bool:
        self._look()
        return self.state == "idle"

    def is_closed(self) -> bool:
        self._look()
        return self.state == "closed"

    def info(self) -> str:
        return self.ident


class _Made:
    """``create_connection`` giving fake new connections with predictable names."""

    made: int

    def create_connection(self, origin: httpcore.Origin) -> httpcore.AsyncConnectionInterface:
        self.made += 1
        return FakeConnection(f"new{self.made}", origin, "new", False)


class TheirPool(_Made, httpcore.AsyncConnectionPool):
    made = 0


class OurPool(_Made, http_pool._Pool):
    made = 0


def _pool_state(pool: httpcore.AsyncConnectionPool, rng: random.Random) -> None:
    """A random pool: connections in every state to two origins, some requests queued."""
    urls = [f"https://api-{i}:6443/x" for i in range(2)]
    pool._connections = [
        FakeConnection(
            f"c{i}",
            httpcore.URL(rng.choice(urls)).origin,
            rng.choice(["idle", "idle", "active", "closed", "new"]),
            rng.random() < 0.15,
        )
        for i in range(rng.randint(0, pool._max_connections or 0))
    ]
    pool._requests = []
    for _ in range(rng.randint(0, 6)):
        request = AsyncPoolRequest(httpcore.Request("GET", rng.choice(urls)))
        if rng.random() < 0.3:  # already given a connection: not queued
            origin = request.request.url.origin
            request.assign_to_connection(FakeConnection("taken", origin, "active", False))
        pool._requests.append(request)


def _name(connection: object) -> str | None:
    return connection.ident if isinstance(connection, FakeConnection) else None


def _outcome(pool: httpcore.AsyncConnectionPool) -> tuple[list[str | None], ...]:
    """What the pool's pass closed, what it keeps, and each request's connection."""
    closing = pool._assign_requests_to_connections()
    return (
        [_name(c) for c in closing],
        [_name(c) for c in pool._connections],
        [_name(r.connection) for r in pool._requests],
    )


async def test_the_pool_decides_as_httpcores_own() -> None:
    """Over random pools (closed, expired, busy and idle connections to two origins, requests
    queued and not, keep-alive limits below and at the pool's size), ``_Pool`` closes, keeps and
    assigns exactly what httpcore's pass does."""
    for seed in range(3000):
        rng = random.Random(seed)
        limits = rng.choice([(4, 4), (4, 2), (8, 8), (8, 3), (1, 1), (3, 0)])
        pools = [
            cls(max_connections=limits[0], max_keepalive_connections=limits[1])
            for cls in (TheirPool, OurPool)
        ]
        for pool in pools:
            _pool_state(pool, random.Random(seed))
        assert _outcome(pools[1]) == _outcome(pools[0]), (seed, limits)


async def test_the_transports_pool_looks_at_each_connection_once() -> None:
    """With 32 idle connections kept, a request's start or end costs the pool one look per
    connection, not one per pair of them (httpcore's own: 32 x 32 ``is_idle`` calls)."""
    limits = httpx.Limits(max_connections=32, max_keepalive_connections=32, keepalive_expiry=60)
    pool = http_pool.transport(False, limits)._pool
    assert isinstance(pool, http_pool._Pool)
    origin = httpcore.URL("https://api:6443/").origin
    pool._connections = [FakeConnection(f"c{i}", origin, "idle", False) for i in range(32)]
    pool._requests = [AsyncPoolRequest(httpcore.Request("GET", "https://api:6443/x"))]
    assert pool._assign_requests_to_connections() == []
    looks = [c.looks for c in pool._connections]  # type: ignore[attr-defined]
    assert pool._requests[0].connection is pool._connections[0]
    # closed? expired? idle? for each; the first one also: same origin? available?
    assert looks == [5] + [3] * 31, looks
    theirs = TheirPool(max_connections=32, max_keepalive_connections=32)
    theirs._connections = [FakeConnection(f"c{i}", origin, "idle", False) for i in range(32)]
    theirs._requests = [AsyncPoolRequest(httpcore.Request("GET", "https://api:6443/x"))]
    theirs._assign_requests_to_connections()
    assert sum(c.looks for c in theirs._connections) > 32 * 32  # type: ignore[attr-defined]


def _swept_pool(connections: list[FakeConnection]) -> http_pool._Pool:
    """A transport's pool of ``connections`` right after a sweep (the next is not due)."""
    limits = httpx.Limits(max_connections=32, max_keepalive_connections=32, keepalive_expiry=60)
    pool = http_pool.transport(False, limits)._pool
    assert isinstance(pool, http_pool._Pool)
    pool._connections = list(connections)
    pool._requests = []
    pool._assign_requests_to_connections()  # the first pass sweeps
    pool._requests = [AsyncPoolRequest(httpcore.Request("GET", "https://api:6443/x"))]
    return pool


async def test_between_sweeps_only_the_connection_taken_is_asked_whether_it_expired() -> None:
    """A request's start or end asks one connection ``has_expired`` (a ``poll`` each, for an
    idle one), not all 32, until the next sweep (``SWEEP_S``)."""
    origin = httpcore.URL("https://api:6443/").origin
    conns = [FakeConnection(f"c{i}", origin, "idle", False) for i in range(32)]
    pool = _swept_pool(conns)
    assert [c.expiry_looks for c in conns] == [1] * 32  # the sweep asked each once
    assert pool._assign_requests_to_connections() == []
    assert pool._requests[0].connection is conns[0]
    assert [c.expiry_looks for c in conns] == [2] + [1] * 31
    pool._swept_at -= http_pool._Pool.SWEEP_S  # a sweep is due again: every one is asked
    pool._requests = [AsyncPoolRequest(httpcore.Request("GET", "https://api:6443/x"))]
    pool._assign_requests_to_connections()
    assert [c.expiry_looks for c in conns] == [3] + [2] * 31


async def test_between_sweeps_no_request_goes_out_on_an_expired_connection() -> None:
    """A connection that expired after the sweep (the server closed it while idle) is closed
    when a request would take it, and the request takes the next one."""
    origin = httpcore.URL("https://api:6443/").origin
    conns = [FakeConnection(f"c{i}", origin, "idle", False) for i in range(3)]
    pool = _swept_pool(conns)
    conns[0].expired = True
    closing = pool._assign_requests_to_connections()
    assert [_name(c) for c in closing] == ["c0"]
    assert pool._requests[0].connection is conns[1]
    assert [_name(c) for c in pool._connections] == ["c1", "c2"]
