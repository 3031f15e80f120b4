"""kopf's connections to the API server are bounded (``k8s/kopf_session.py``, issue 24).

What kopf logs in with (the operator's login handler, against the real API server's
kubeconfig) is turned into kopf's API context as kopf does it (``APIContext``), and 200 requests
are sent through its session at once, as kopf patches its finalizer onto 200 OmniStages that
appear together. The connections this process then holds to the API server are read from
outside the session (``/proc``, psutil). Before the change the login gave kopf bare
credentials, kopf built a session with no connection limit, and each request in flight opened a
connection of its own (316 at once in the operator at 600 stages, bench/scale_memory.py), each
with its TLS state and a 256 KiB read buffer.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any, cast
from urllib.parse import urlsplit

import kopf
import psutil
import pytest
from kopf._cogs.clients.auth import APIContext

from omnistage_operator.k8s.kopf_session import connection_limit
from omnistage_operator.runtime import login
from tests.cluster.controlplane import ControlPlane

pytestmark = [pytest.mark.timeout(120)]

REQUESTS = 200


def _held(port: int) -> int:
    conns = psutil.Process().net_connections(kind="tcp")
    return sum(1 for c in conns if c.raddr and c.raddr.port == port and c.status == "ESTABLISHED")


async def test_requests_at_once_share_a_bounded_number_of_connections(
    control_plane: ControlPlane, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(control_plane.kubeconfig))
    port = urlsplit(control_plane.server).port
    assert port is not None
    login.configure((namespace,))
    handler = cast(Callable[..., Awaitable[Any]], login.login_with_kubeconfig)  # kopf's type
    info = await handler(logger=logging.getLogger("test"), settings=kopf.OperatorSettings())
    assert info is not None
    context = APIContext(info)
    url = f"{control_plane.server}/api/v1/namespaces/{namespace}"
    before = _held(port)

    async def get() -> int:
        async with context.session.get(url) as resp:
            await resp.read()
            return resp.status

    try:
        statuses = await asyncio.gather(*(get() for _ in range(REQUESTS)))
        opened = _held(port) - before  # idle in the pool now, kept alive
    finally:
        await context.close()
    assert statuses == [200] * REQUESTS
    limit = connection_limit((namespace,))
    print(f"{REQUESTS} requests at once: {opened} connections (limit {limit}, pid {os.getpid()})")
    assert 0 < opened <= limit
