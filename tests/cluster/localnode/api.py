"""A small asyncio Kubernetes REST client (httpx) with list+watch, enough for localnode."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import httpx

from tests.cluster.kubeconfig import KubeAuth, auth_context

Obj = dict[str, Any]


class ApiError(RuntimeError):
    """A non-2xx answer from the API server."""

    def __init__(self, method: str, path: str, status: int, body: str):
        super().__init__(f"{method} {path}: HTTP {status}: {body[:500]}")
        self.status = status


# Connections to the API server: enough for hundreds of pods' status writes at once; a request
# beyond them waits for a free one (no pool timeout: a burst queues, it does not fail).
MAX_CONNECTIONS = 64


class Api:
    """Async client for one API server; ``requests`` counts what it sent, by verb."""

    def __init__(self, auth: KubeAuth):
        self.auth = auth
        ctx = auth_context(auth)
        headers = {"Authorization": f"Bearer {auth.token}"} if auth.token else {}
        self._client = httpx.AsyncClient(
            base_url=auth.server,
            verify=ctx,
            headers=headers,
            timeout=httpx.Timeout(30.0, pool=None),
            limits=httpx.Limits(
                max_connections=MAX_CONNECTIONS, max_keepalive_connections=MAX_CONNECTIONS
            ),
        )
        self.requests: Counter[str] = Counter()

    async def close(self) -> None:
        """Close the connection pool."""
        await self._client.aclose()

    async def request(
        self,
        method: str,
        path: str,
        body: Obj | None = None,
        params: dict[str, str] | None = None,
        patch: str = "merge",
    ) -> Obj:
        """Send a request; ``patch`` picks the PATCH content type (merge, strategic, apply)."""
        headers = {}
        content = None
        if body is not None:
            content = json.dumps(body)
            headers["Content-Type"] = (
                {
                    "merge": "application/merge-patch+json",
                    "strategic": "application/strategic-merge-patch+json",
                    "json": "application/json-patch+json",
                }.get(patch, "application/json")
                if method == "PATCH"
                else "application/json"
            )
        self.requests[method] += 1
        r = await self._client.request(
            method, path, content=content, params=params, headers=headers
        )
        if r.status_code >= 300:
            raise ApiError(method, path, r.status_code, r.text)
        data: Obj = r.json() if r.content else {}
        return data

    async def get(self, path: str, params: dict[str, str] | None = None) -> Obj:
        """GET ``path``."""
        return await self.request("GET", path, params=params)

    async def get_or_none(self, path: str) -> Obj | None:
        """GET ``path``, None if it does not exist."""
        try:
            return await self.get(path)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def create(self, path: str, body: Obj) -> Obj:
        """POST ``body`` to collection ``path``."""
        return await self.request("POST", path, body)

    async def patch(self, path: str, body: Obj, patch: str = "merge") -> Obj:
        """PATCH ``path``."""
        return await self.request("PATCH", path, body, patch=patch)

    async def delete(self, path: str, body: Obj | None = None) -> Obj:
        """DELETE ``path`` (404 is not an error)."""
        try:
            return await self.request("DELETE", path, body)
        except ApiError as exc:
            if exc.status == 404:
                return {}
            raise

    async def watch(
        self, path: str, params: dict[str, str], timeout_s: int = 300
    ) -> AsyncIterator[Obj]:
        """Yield watch events (``type``, ``object``) from ``path`` until the server ends it."""
        query = dict(params, watch="1", allowWatchBookmarks="true", timeoutSeconds=str(timeout_s))
        timeout = httpx.Timeout(30.0, read=timeout_s + 30.0, pool=None)
        self.requests["WATCH"] += 1
        async with self._client.stream("GET", path, params=query, timeout=timeout) as r:
            if r.status_code >= 300:
                raise ApiError("WATCH", path, r.status_code, (await r.aread()).decode())
            async for line in r.aiter_lines():
                if line.strip():
                    yield json.loads(line)
