"""A status write the caller wants no answer to is read but not decoded (``Kube.merge_patch``
with ``answer=False``); every other call decodes what the API answered."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from omnistage_operator.k8s.kube import OMNISTAGE, Kube

# What the API server answered, cut short: decoding it fails.
TRUNCATED = b'{"apiVersion": "omnistage.io/v1alpha1", "kind": "OmniStage", "status": {"st'


class Api:
    """kr8s's ``call_api`` answering every request with ``content``; requests noted."""

    def __init__(self, content: bytes) -> None:
        self.content = content
        self.requests: list[tuple[str, str, dict[str, Any]]] = []

    @contextlib.asynccontextmanager
    async def call_api(self, method: str, **kwargs: Any) -> AsyncIterator[httpx.Response]:
        self.requests.append((method, kwargs["url"], kwargs))
        yield httpx.Response(200, content=self.content)


async def test_a_status_write_without_an_answer_is_not_decoded() -> None:
    api = Api(TRUNCATED)
    kube = Kube(api)
    patch = {"status": {"state": "Asleep"}}
    answer = await kube.merge_patch(OMNISTAGE, "ns", "s", patch, status=True, answer=False)
    assert answer == {}
    method, url, sent = api.requests[0]
    assert (method, url) == ("PATCH", "omnistages/s/status")
    assert sent["content"] == '{"status": {"state": "Asleep"}}'
    with pytest.raises(ValueError):  # the same answer, decoded: what every other call does
        await kube.merge_patch(OMNISTAGE, "ns", "s", patch, status=True)


async def test_other_calls_return_what_the_api_answered() -> None:
    kube = Kube(Api(b'{"metadata": {"name": "s"}}'))
    assert await kube.merge_patch(OMNISTAGE, "ns", "s", {"spec": {}}) == {"metadata": {"name": "s"}}
    assert await kube.get(OMNISTAGE, "ns", "s") == {"metadata": {"name": "s"}}
