"""The operator's API requests under a storm, against the real API server: at most
``API_CONCURRENCY`` reach httpx's connection pool at once (its per-request bookkeeping scans
every connection for every request queued in it), and a burst of Events takes at most
``EVENT_CONCURRENCY`` of them, so a round's read does not wait behind the Events; the client
``Kube.connect`` builds keeps a connection per slot open, across a pause between storms."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import kr8s.asyncio
import pytest
from prometheus_client import REGISTRY

from omnistage_operator.k8s.kube import API_CONCURRENCY, EVENT_CONCURRENCY, Kube
from tests.cluster.controlplane import ControlPlane

pytestmark = [pytest.mark.timeout(180)]
EVENTS = 300


def waits(lane: str) -> float:
    """Requests of ``lane`` counted by ``omnistage_api_wait_seconds`` so far."""
    return REGISTRY.get_sample_value("omnistage_api_wait_seconds_count", {"lane": lane}) or 0.0


class PoolWatch:
    """The most requests httpx's pool held at once (queued or being sent), and the connections
    it opened."""

    def __init__(self, pool: Any) -> None:
        self.most = 0
        self.opened = 0
        assign = pool._assign_requests_to_connections
        create = pool.create_connection

        def watched() -> Any:
            self.most = max(self.most, len(pool._requests))
            return assign()

        def created(origin: Any) -> Any:
            self.opened += 1
            return create(origin)

        pool._assign_requests_to_connections = watched
        pool.create_connection = created


def pool_of(kube: Kube) -> Any:
    session: Any = kube.api._session
    return session._transport._pool


async def test_a_storm_of_events_neither_floods_the_pool_nor_delays_a_read(
    control_plane: ControlPlane, namespace: str
) -> None:
    cp = control_plane
    cp.kubectl("create", "configmap", "subject", "-n", namespace)
    subject = cp.get_json("configmap", "subject", namespace=namespace)
    api = await kr8s.asyncio.api(kubeconfig=str(cp.kubeconfig))
    kube = Kube(api)
    await kube.get(kr8s.asyncio.objects.ConfigMap, namespace, "subject")  # the session exists
    watch = PoolWatch(pool_of(kube))
    before = {lane: waits(lane) for lane in ("event", "request")}

    # distinct reasons: every one is a new Event (a POST), none aggregated into another
    storm = [
        asyncio.create_task(kube.event(subject, reason=f"Storm{i}", message="m"))
        for i in range(EVENTS)
    ]
    await asyncio.sleep(0)  # every Event task has started and asked for its request
    t0 = time.monotonic()
    read = await kube.get(kr8s.asyncio.objects.ConfigMap, namespace, "subject")
    took = time.monotonic() - t0
    posted_before_read = sum(t.done() for t in storm)
    await asyncio.gather(*storm)

    assert read is not None and read["metadata"]["name"] == "subject"
    assert watch.most <= API_CONCURRENCY, watch.most
    # the read went ahead of the Events still waiting (before: behind all of them)
    assert posted_before_read <= 4 * EVENT_CONCURRENCY, (posted_before_read, took)
    # where the requests waited is in the operator's metrics
    assert waits("event") - before["event"] == EVENTS
    assert waits("request") - before["request"] == 1
    listed = cp.get_json("events", namespace=namespace)["items"]
    assert sum(e["reason"].startswith("Storm") for e in listed) == EVENTS


async def test_connections_are_kept_for_every_slot_and_across_a_pause(
    control_plane: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both ways a request goes: the aiohttp lane ``Kube.connect`` builds (``aio_lane``), and
    kr8s's client (without the lane, or when the lane cannot answer)."""
    monkeypatch.setenv("KUBECONFIG", str(control_plane.kubeconfig))
    kube = await Kube.connect()
    lane = kube.lane
    assert lane is not None
    watch = PoolWatch(pool_of(kube))

    async def burst() -> None:
        reads = [kube.get(kr8s.asyncio.objects.Namespace, "", "default") for _ in range(64)]
        assert all(r is not None for r in await asyncio.gather(*reads))

    def through_lane() -> int:
        return lane.opened

    def through_kr8s() -> int:
        return watch.opened

    for opened in (through_lane, through_kr8s):
        await burst()
        first = opened()
        assert 0 < first <= API_CONCURRENCY
        await burst()  # before: kr8s's client kept 20 and opened (and TLS-shook) the rest again
        assert opened() == first
        await asyncio.sleep(6)  # longer than httpx's default keep-alive expiry (5 s)
        await burst()
        assert opened() == first
        kube.set_lane(None)  # then the same through kr8s's client
