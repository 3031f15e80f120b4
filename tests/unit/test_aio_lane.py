"""The operator's requests go over its aiohttp lane when it has one (``k8s.aio_lane``), with
kr8s's results: the answer decoded or not, 404 as absent, the API's own message on an error;
a request the lane cannot answer (credentials refused, no connection) goes through kr8s."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from kr8s._api import Api as Kr8sApi

from omnistage_operator.k8s.aio_lane import AioLane
from omnistage_operator.k8s.kube import OMNISTAGE, Kube, KubeError


class Api:
    """kr8s's ``call_api`` answering 200 ``{"via": "kr8s"}``; its requests noted."""

    _construct_url = Kr8sApi._construct_url

    def __init__(self) -> None:
        self.requests: list[tuple[str, str]] = []

    @contextlib.asynccontextmanager
    async def call_api(self, method: str, **kwargs: Any) -> AsyncIterator[httpx.Response]:
        self.requests.append((method, kwargs["url"]))
        yield httpx.Response(200, content=b'{"via": "kr8s"}')


class Server:
    """A plain HTTP/1.1 server answering each request with the next (status, body) of
    ``answers`` (the last one again when they run out); the requests it read are noted."""

    def __init__(self, *answers: tuple[int, bytes]) -> None:
        self.answers = list(answers)
        self.seen: list[tuple[str, str, dict[str, str], bytes]] = []
        self.server: asyncio.Server | None = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while line := await reader.readline():
            method, path, _ = line.decode().split(" ", 2)
            headers: dict[str, str] = {}
            while (h := await reader.readline()) not in (b"\r\n", b""):
                k, v = h.decode().split(":", 1)
                headers[k.strip().lower()] = v.strip()
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            self.seen.append((method, path, headers, body))
            status, answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
            head = f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n"
            writer.write(f"{head}Content-Length: {len(answer)}\r\n\r\n".encode() + answer)
            await writer.drain()
        writer.close()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()


def _kube(url: str) -> tuple[Kube, Api]:
    api = Api()
    kube = Kube(api)
    kube.set_lane(AioLane(url, {"Authorization": "Bearer t"}, False))
    return kube, api


async def test_a_status_write_goes_over_the_lane_with_kr8s_credentials() -> None:
    server = Server((200, b'{"metadata": {"name": "s"}}'))
    async with server as url:
        kube, api = _kube(url)
        patch = {"status": {"state": "Asleep"}}
        answer = await kube.merge_patch(OMNISTAGE, "ns", "s", patch, status=True, answer=False)
        assert answer == {}
        assert await kube.get(OMNISTAGE, "ns", "s") == {"metadata": {"name": "s"}}
        assert kube.lane is not None
        await kube.lane.close()
    assert api.requests == []  # kr8s's client sent nothing
    method, path, headers, body = server.seen[0]
    assert (method, path) == (
        "PATCH",
        "/apis/omnistage.io/v1alpha1/namespaces/ns/omnistages/s/status",
    )
    assert headers["authorization"] == "Bearer t"
    assert headers["content-type"] == "application/merge-patch+json"
    assert json.loads(body) == patch
    assert server.seen[1][:2] == ("GET", "/apis/omnistage.io/v1alpha1/namespaces/ns/omnistages/s")


async def test_errors_read_as_kr8s_ones_did() -> None:
    conflict = b'{"kind": "Status", "message": "omnistages \\"s\\" already exists"}'
    server = Server((404, b'{"kind": "Status", "message": "not found"}'), (409, conflict))
    async with server as url:
        kube, _ = _kube(url)
        assert await kube.get(OMNISTAGE, "ns", "s") is None  # absent
        with pytest.raises(KubeError) as err:
            await kube.merge_patch(OMNISTAGE, "ns", "s", {"spec": {}})
        assert err.value.status == 409
        assert 'omnistages "s" already exists' in str(err.value)
        assert kube.lane is not None
        await kube.lane.close()


async def test_a_body_is_sent_as_json_with_its_content_type() -> None:
    server = Server((201, b'{"metadata": {"name": "e.1"}}'))
    async with server as url:
        kube, _ = _kube(url)
        obj = {"metadata": {"name": "x"}, "spec": {"a": 1}}
        assert await kube.create_returning(OMNISTAGE, "ns", obj) == {"metadata": {"name": "e.1"}}
        assert kube.lane is not None
        await kube.lane.close()
    _, path, headers, body = server.seen[0]
    assert path == "/apis/omnistage.io/v1alpha1/namespaces/ns/omnistages"
    assert headers["content-type"] == "application/json"
    assert json.loads(body)["metadata"] == {"name": "x", "namespace": "ns"}


async def test_refused_credentials_go_through_kr8s_which_re_authenticates() -> None:
    server = Server((401, b'{"kind": "Status", "message": "Unauthorized"}'))
    async with server as url:
        kube, api = _kube(url)
        assert await kube.get(OMNISTAGE, "ns", "s") == {"via": "kr8s"}
        assert kube.lane is not None
        await kube.lane.close()
    assert api.requests == [("GET", "omnistages/s")]


async def test_no_connection_goes_through_kr8s() -> None:
    server = Server((200, b"{}"))
    async with server as url:
        pass  # closed: nothing listens there now
    kube, api = _kube(url)
    assert await kube.get(OMNISTAGE, "ns", "s") == {"via": "kr8s"}
    assert api.requests == [("GET", "omnistages/s")]
    assert kube.lane is not None
    await kube.lane.close()


async def test_closing_the_kube_closes_its_lane() -> None:
    server = Server((200, b"{}"))
    async with server as url:
        kube, _ = _kube(url)
        lane = kube.lane
        assert lane is not None
        await kube.get(OMNISTAGE, "ns", "s")
        session = lane._session
        assert session is not None and not session.closed
        await kube.close()
        assert kube.lane is None and session.closed
