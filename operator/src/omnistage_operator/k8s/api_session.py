"""How the operator's Kubernetes client connects: kr8s's httpx client with the connections kept
that a storm needs, on the operator's transport (``http_pool``), and beside it an aiohttp lane
with the same credentials (``aio_lane``), rebuilt with it."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import httpx

from omnistage_operator.k8s import aio_lane, http_pool

__all__ = [
    "API_CONCURRENCY",
    "EVENT_CONCURRENCY",
    "KEEP_CONNECTIONS",
    "KEEP_IDLE_S",
    "keep_connections",
]

# Requests in flight to the API server at once, and connections kept open for them (as many).
# httpcore's pool scans every connection for every queued request each time a request starts or
# ends: with a storm's hundreds of requests queued in it (a round's and its Events') that scan
# was half the operator's CPU (py-spy over a 200-stage hand-over storm). Requests beyond the
# limit wait on a semaphore instead, which costs nothing per waiter. kr8s builds its httpx client
# with httpx's default (20 kept alive): every connection beyond that would be closed after its
# request, and the next burst pay a new TLS handshake for each. They are kept across the pauses
# between storms too (httpx closes a connection idle for 5 s by default).
API_CONCURRENCY = 32
KEEP_CONNECTIONS = API_CONCURRENCY
KEEP_IDLE_S = 300.0
# Event posts (and their aggregation patches) in flight at once: Events are best effort and come
# in bursts (several per hand-over), so they take few of the request slots; a round's reads and
# status writes never queue behind a storm's Events.
EVENT_CONCURRENCY = 4
# The environment's proxy variables httpx honours (then its own transports are kept).
_PROXY_VARS = tuple(
    v for name in ("http", "https", "all") for v in (f"{name}_proxy", f"{name.upper()}_PROXY")
)


async def keep_connections(
    api: Any, lane_to: Callable[[aio_lane.AioLane | None], None] | None = None
) -> None:
    """Make ``api`` (a kr8s Api) build its httpx client with ``KEEP_CONNECTIONS`` kept alive
    for ``KEEP_IDLE_S``, now (kr8s built one with httpx's defaults for its version check) and
    whenever it rebuilds it (kr8s does on a 401/403 re-authentication); and each time, hand
    ``lane_to`` an aiohttp lane with the same credentials (None through a proxy)."""
    build = api._create_session

    async def create_session() -> None:
        await build()
        old = api._session
        verify = await api.auth.ssl_context()
        limits = httpx.Limits(
            max_connections=KEEP_CONNECTIONS,
            max_keepalive_connections=KEEP_CONNECTIONS,
            keepalive_expiry=KEEP_IDLE_S,
        )
        # through a proxy (kubeconfig's or the environment's), httpx's own transports
        direct = not api.auth.proxy and not any(os.environ.get(v) for v in _PROXY_VARS)
        api._session = httpx.AsyncClient(
            base_url=old.base_url,
            headers=old.headers,
            verify=verify,
            timeout=old.timeout,
            follow_redirects=True,
            proxy=api.auth.proxy,
            limits=limits,
            transport=http_pool.transport(verify, limits) if direct else None,
        )
        await old.aclose()
        if lane_to is not None:
            lane_to(_lane(api.auth, old, verify) if direct else None)

    api._create_session = create_session
    await create_session()


def _lane(auth: Any, client: httpx.AsyncClient, verify: Any) -> aio_lane.AioLane:
    """An aiohttp lane with kr8s's server, headers (its ``Authorization``), TLS and timeouts."""
    return aio_lane.AioLane(
        auth.server, dict(client.headers), verify, server_hostname=auth.tls_server_name,
        limit=KEEP_CONNECTIONS, keep_s=KEEP_IDLE_S, read_timeout_s=client.timeout.read,
        connect_timeout_s=client.timeout.connect,
    )  # fmt: skip
