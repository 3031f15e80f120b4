"""kopf's HTTP session to the API server, with a bounded number of connections.

kopf builds its aiohttp session with no connection limit: each of its requests in flight at once
opens a connection of its own, a TCP connect and a TLS handshake, and keeps it idle 15 s after.
When hundreds of OmniStages appear at once (a fleet applied, an operator that starts over
existing ones) kopf patches its finalizer onto each: the operator held 316 connections to the
API server at once at 600 stages, each with asyncio's 256 KiB TLS read buffer, and the heap
they grew stays with the process after they close (bench/scale_memory.py). The session built
here is kopf's own (the same credentials, TLS context, headers, proxy) over a connector that
opens at most :func:`connection_limit` connections; the requests beyond wait for one.

kopf's watches each hold a connection for as long as they stream, so the limit counts them
apart: :data:`STREAMS_PER_NAMESPACE` per served namespace (one when the operator serves the
whole cluster) and :data:`CLUSTER_STREAMS` for kopf's own scanning, plus
:data:`REQUEST_CONNECTIONS` for the requests. Namespaces given as patterns match an unknown
number of namespaces: then the session is kopf's unbounded one.
"""

from __future__ import annotations

from collections.abc import Sequence

import aiohttp
import kopf

__all__ = [
    "CLUSTER_STREAMS",
    "REQUEST_CONNECTIONS",
    "STREAMS_PER_NAMESPACE",
    "bounded_session",
    "connection_limit",
]

REQUEST_CONNECTIONS = 32
"""Connections for kopf's requests (finalizer and progress patches, its Events) at once."""
STREAMS_PER_NAMESPACE = 4
"""Watches per served namespace: OmniStages, worker pods, OmniPipelines, kopf's peering."""
CLUSTER_STREAMS = 4
"""kopf's cluster-wide watches for its scanning (custom resource definitions, namespaces)."""
_PATTERN_CHARS = frozenset("*?[]!,")


def connection_limit(namespaces: Sequence[str]) -> int:
    """Connections kopf may hold at once serving ``namespaces`` (empty: the whole cluster);
    0 (no limit, kopf's own) when a namespace is a pattern."""
    if any(_PATTERN_CHARS & set(ns) for ns in namespaces):
        return 0
    served = max(1, len(namespaces))
    return REQUEST_CONNECTIONS + STREAMS_PER_NAMESPACE * served + CLUSTER_STREAMS


def bounded_session(info: kopf.ConnectionInfo, limit: int) -> kopf.AiohttpSession:
    """The session kopf would build for ``info``, its connector opening at most ``limit``
    connections (0: any number). Call in the event loop kopf runs in."""
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=limit, ssl=info.as_ssl_context()),
        headers=info.as_http_headers(),
        proxy=info.proxy_url,
        trust_env=info.trust_env,
    )
    return kopf.AiohttpSession(
        aiohttp_session=session,
        server=info.server,
        default_namespace=info.default_namespace,
        priority=info.priority,
        expiration=info.expiration,
    )
