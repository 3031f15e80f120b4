"""The operator's HTTP transport finds each connection's socket once, and still sees a
connection the server closed (``k8s.http_pool``)."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import httpcore
import httpx

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
