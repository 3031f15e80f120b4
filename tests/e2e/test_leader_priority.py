"""The chart's FlowSchema keeps Lease renewals on time while the API server is flooded (issue 24).

The API server shares a fixed number of seats among its priority levels (API Priority and
Fairness). Without the chart's FlowSchema the operator's Lease requests match the built-in
``service-accounts`` schema and wait in the ``workload-low`` queue of the operator's own flow,
behind every other request it sent; under a storm they land after the renew deadline and the
single leader loses its Lease. The chart sends them to the ``leader-election`` level instead.

A control plane with two seats in all (so ``workload-low`` serves about one request at a time)
is flooded with LISTs by the operator's ServiceAccount, while the operator's own ``Elector``
(same code, same identity) holds the chart's Lease: first without the FlowSchema (the renewals
come late: leadership is lost), then with it (every renewal lands: no loss, and the response
headers name the chart's FlowSchema and the leader-election level).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import kr8s
import pytest

from omnistage_operator.decisions.election import Timing
from omnistage_operator.k8s.leader import Elector, KrLeaseStore, new_identity
from tests.cluster.controlplane import ControlPlane
from tests.cluster.kubeconfig import auth_context, load_kubeconfig
from tests.cluster.procs import wait_for
from tests.e2e.test_helm_support import (
    InstalledRelease,
    get_as,
    install_chart,
    lease_path,
    operator_kubeconfig,
    upgrade_chart,
)

pytestmark = [pytest.mark.timeout(300)]

TIMING = Timing(3.0, 2.0, 0.5)  # lease, renew deadline, retry: each try may take 1 s
FLOOD_CLIENTS = 6  # concurrent LISTs by the operator's identity
STALL_S = 2.5  # each flood client reads nothing of its answer for this long, then hangs up
HOLD_S = 15.0  # how long each phase floods while the elector holds the Lease
# Namespaces with random annotations: a LIST answers ~12 MB, more than the loopback socket
# buffers hold, so the API server's handler (and its seat) waits on a client that does not read.
BALLAST = (120, 100_000)
FLOOD_PATH = "/api/v1/namespaces"  # the chart lets the operator list namespaces
PF_SCHEMA = "X-Kubernetes-PF-FlowSchema-UID"
PF_LEVEL = "X-Kubernetes-PF-PriorityLevel-UID"


class Background:
    """An asyncio loop on its own thread running ``main(stop)`` until ``close``."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None

    async def main(self) -> None:
        """The work; returns once ``self.stop`` is set."""
        raise NotImplementedError

    def _run(self) -> None:
        try:
            asyncio.run(self.main())
        except BaseException as exc:  # reported by close()
            self.error = exc

    def start(self) -> None:
        """Start the thread."""
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop and join; re-raise what the loop raised."""
        self.stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            assert not self._thread.is_alive(), f"{type(self).__name__} did not stop"
        if self.error is not None:
            raise self.error

    async def _until_stopped(self) -> None:
        await asyncio.to_thread(self.stop.wait)


class Flood(Background):
    """``FLOOD_CLIENTS`` loops LISTing CRDs as the operator's ServiceAccount."""

    def __init__(self, kubeconfig: Path) -> None:
        super().__init__()
        self.auth = load_kubeconfig(kubeconfig)
        self.codes: dict[int, int] = {}

    async def _client(self, http: httpx.AsyncClient) -> None:
        while not self.stop.is_set():
            try:
                async with http.stream("GET", FLOOD_PATH) as r:
                    self.codes[r.status_code] = self.codes.get(r.status_code, 0) + 1
                    await asyncio.sleep(STALL_S)
            except httpx.HTTPError:
                self.codes[0] = self.codes.get(0, 0) + 1

    async def main(self) -> None:
        """Run the clients until stopped."""
        limits = httpx.Limits(max_connections=FLOOD_CLIENTS)
        headers = {"Authorization": f"Bearer {self.auth.token}", "Accept-Encoding": "identity"}
        async with httpx.AsyncClient(
            base_url=self.auth.server, verify=auth_context(self.auth), headers=headers,
            limits=limits, timeout=60,
        ) as http:  # fmt: skip
            tasks = [asyncio.create_task(self._client(http)) for _ in range(FLOOD_CLIENTS)]
            await self._until_stopped()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


class ElectorThread(Background):
    """The operator's ``Elector`` on the chart's Lease, as the chart's ServiceAccount."""

    def __init__(self, kubeconfig: Path, release: InstalledRelease) -> None:
        super().__init__()
        self.kubeconfig = kubeconfig
        self.release = release
        self.acquired: list[int] = []
        self.lost = 0
        self.elector: Elector | None = None

    def _on_lost(self) -> None:
        self.lost += 1

    async def main(self) -> None:
        """Elect until stopped."""
        api = await kr8s.asyncio.api(kubeconfig=str(self.kubeconfig))
        store = KrLeaseStore(api, self.release.namespace, self.release.fullname)
        self.elector = Elector(
            store, new_identity("prio"), TIMING,
            on_acquired=self.acquired.append, on_lost=self._on_lost,
        )  # fmt: skip
        task = asyncio.create_task(self.elector.run())
        await self._until_stopped()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    def leading(self) -> bool:
        """The elector holds the Lease and renewed it within the deadline."""
        return self.elector is not None and self.elector.leading()


def uid(cp: ControlPlane, kind: str, name: str) -> str:
    """The uid of a cluster-scoped object."""
    obj: dict[str, Any] = cp.get_json(kind, name)
    return str(obj["metadata"]["uid"])


def hold_under_flood(
    cp: ControlPlane, kubeconfig: Path, release: InstalledRelease
) -> tuple[ElectorThread, Flood]:
    """Acquire the Lease, then flood the API server for ``HOLD_S`` seconds while holding it."""
    elector = ElectorThread(kubeconfig, release)
    flood = Flood(kubeconfig)
    elector.start()
    try:
        wait_for("the elector leading", elector.leading, 30, interval=0.1)
        flood.start()
        try:
            deadline = time.monotonic() + HOLD_S
            while time.monotonic() < deadline and not elector.lost:
                time.sleep(0.1)
        finally:
            flood.close()
    finally:
        elector.close()
    print(f"flood answers {flood.codes}; acquired {elector.acquired}, lost {elector.lost}")
    dump = cp.kubectl("get", "--raw", "/debug/api_priority_and_fairness/dump_priority_levels")
    print(dump.stdout)
    return elector, flood


def noise(size: int) -> str:
    """``size`` random characters (they do not compress)."""
    return secrets.token_urlsafe(size)[:size]


@pytest.fixture(scope="module")
def seat_poor_plane() -> Iterator[ControlPlane]:
    """A control plane with 2 seats in all: about one per priority level."""
    with ControlPlane(controller_manager=False, max_inflight=(1, 1)) as cp:
        count, size = BALLAST
        ballast = [
            {
                "apiVersion": "v1",
                "kind": "Namespace",
                "metadata": {"name": f"ballast-{i}", "annotations": {"ballast": noise(size)}},
            }
            for i in range(count)
        ]
        cp.kubectl(
            "create",
            "-f",
            "-",
            input=json.dumps({"apiVersion": "v1", "kind": "List", "items": ballast}),
        )
        yield cp


def test_lease_renewals_go_through_the_flow_schema_under_a_flood(
    seat_poor_plane: ControlPlane,
) -> None:
    cp = seat_poor_plane
    level = uid(cp, "prioritylevelconfiguration", "leader-election")  # built in
    service_accounts = uid(cp, "flowschema", "service-accounts")
    release = install_chart(cp, {"leaderElection": {"flowSchema": {"enabled": False}}})
    kubeconfig = operator_kubeconfig(cp, release)
    _, r = get_as(kubeconfig, lease_path(release))  # 404: no Lease yet
    assert PF_SCHEMA in r.headers, "API Priority and Fairness is off"
    assert r.headers[PF_SCHEMA] == service_accounts

    # Without the FlowSchema the renewals queue behind the flood and come late.
    without, flood = hold_under_flood(cp, kubeconfig, release)
    assert flood.codes.get(200, 0) > 0
    assert without.lost >= 1, "the flood did not delay the renewals: the test shows nothing"

    upgrade_chart(cp, release, {})  # the chart's defaults: the FlowSchema on
    schema = uid(cp, "flowschema", f"{release.fullname}-leader-election")
    wait_for(
        "the Lease requests served by the chart's FlowSchema",
        lambda: get_as(kubeconfig, lease_path(release))[1].headers.get(PF_SCHEMA) == schema,
        30, interval=0.2,
    )  # fmt: skip
    _, r = get_as(kubeconfig, lease_path(release))
    assert r.headers[PF_LEVEL] == level

    with_schema, flood = hold_under_flood(cp, kubeconfig, release)
    assert flood.codes.get(200, 0) > 0
    assert with_schema.lost == 0
    assert len(with_schema.acquired) == 1
    # Only the Lease: the rest of what the ServiceAccount sends keeps its usual schema.
    _, r = get_as(kubeconfig, "/api/v1/namespaces?limit=1")
    assert r.status_code == 200 and r.headers[PF_SCHEMA] == service_accounts
