"""Two operator processes elect a leader on the real API server; the workers enforce the epoch.

Short election timings (lease 3 s, renew deadline 2 s, retry 0.5 s) keep the tests quick; the
defaults only scale them. Each operator reaches the API server through its own TCP proxy
(tests/e2e/test_leader_support.py) and carries its own ``POD_NAME``.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from omnistage_operator.decisions.arbiter import WorkerPhase
from tests.e2e.conftest import CAPACITY, SERIAL, Cluster, Gpu, stage_manifest, wait_for
from tests.e2e.test_handover import MemoryWatch
from tests.e2e.test_leader_support import ElectedOperator, LeaseReader, Watcher, WorkerProbe

pytestmark = [pytest.mark.timeout(600)]

TIMING = (3.0, 2.0, 0.5)  # lease duration, renew deadline, retry period
LEASE_S = TIMING[0]


@pytest.fixture
def lease(cluster: Cluster) -> Iterator[LeaseReader]:
    reader = LeaseReader(cluster.cp, cluster.namespace)
    yield reader
    reader.close()


def _pair(cluster: Cluster, tmp_path: Path, **kw: Path) -> tuple[ElectedOperator, ElectedOperator]:
    a = ElectedOperator(
        cluster.cp, cluster.namespace, tmp_path / "a", "op-a", TIMING,
        stop_before_wake=kw.get("stop_before_wake"),
    )  # fmt: skip
    b = ElectedOperator(cluster.cp, cluster.namespace, tmp_path / "b", "op-b", TIMING)
    return a, b


def _leads(lease: LeaseReader, op: ElectedOperator) -> bool:
    return lease.holder().startswith(op.name + "_")


def _start_with_leader(
    cluster: Cluster, lease: LeaseReader, a: ElectedOperator, b: ElectedOperator
) -> None:
    """a leads (started first), b stands by; ar Active and sd Asleep in one group."""
    a.start()
    wait_for("op-a holding the lease", lambda: _leads(lease, a), 30)
    b.start()
    wait_for("op-b a standby", lambda: b.gauge("omnistage_leader") == 0.0, 30)


def _stages(cluster: Cluster, models: dict[str, Path], node: str) -> None:
    cluster.apply(stage_manifest("ar", "ar", models, node, state="Active"))
    cluster.apply(stage_manifest("sd", "sd", models, node, state="Asleep"))
    wait_for("ar Active", lambda: cluster.state("ar") == "Active", 180)
    wait_for("sd Asleep", lambda: cluster.state("sd") == "Asleep", 60)


def _finish(*ops: ElectedOperator) -> None:
    for op in ops:
        op.shutdown()
        print(f"--- {op.name} log tail ---\n{op.tail(40)}")


def test_stopped_leader_is_replaced_within_lease_duration_plus_2s(
    cluster: Cluster, lease: LeaseReader, tiny_models: dict[str, Path], gpu_node: str,
    tmp_path: Path,
) -> None:  # fmt: skip
    a, b = _pair(cluster, tmp_path)
    try:
        _start_with_leader(cluster, lease, a, b)
        _stages(cluster, tiny_models, gpu_node)
        probe = WorkerProbe(cluster.cp, cluster.namespace, ["ar", "sd"])
        first = lease.get()
        assert first is not None and first["spec"]["leaseTransitions"] == 1
        assert first["spec"]["leaseDurationSeconds"] == LEASE_S

        # SIGSTOP: op-a keeps its connections and its lease record, and stops renewing.
        a.signal(signal.SIGSTOP)
        t0 = time.monotonic()
        wait_for("op-b holding the lease", lambda: _leads(lease, b), 30)
        failover = time.monotonic() - t0
        print(f"failover after SIGSTOP of the leader: {failover:.2f}s (lease {LEASE_S}s)")
        assert failover <= LEASE_S + 2, f"failover took {failover:.2f}s"
        taken = lease.get()
        assert taken is not None and taken["spec"]["leaseTransitions"] == 2
        wait_for("op-b reporting leadership", lambda: b.gauge("omnistage_leader") == 1.0, 10)
        assert b.gauge("omnistage_leader_epoch") == 2.0

        # The new leader hands over, with its epoch.
        cluster.patch_state("ar", "Asleep")
        cluster.patch_state("sd", "Active")
        wait_for("sd Active under op-b", lambda: cluster.state("sd") == "Active", 120)
        sd, ar = probe.status("sd"), probe.status("ar")
        assert sd is not None and ar is not None
        assert sd.report.phase is WorkerPhase.ACTIVE and ar.report.phase is WorkerPhase.ASLEEP

        # Resumed, op-a finds op-b holding: it stands by, its gauge says so, nothing changes.
        a.signal(signal.SIGCONT)
        wait_for("op-a a standby", lambda: a.gauge("omnistage_leader") == 0.0, 10)
        assert _leads(lease, b)
        assert 'omnistage_leader_transitions_total{change="lost"} 1.0' in a.metrics()

        def lease_event_reasons() -> set[str]:
            return {
                e["reason"]
                for e in cluster.cp.get_json(
                    "events", "--field-selector", "involvedObject.kind=Lease",
                    namespace=cluster.namespace,
                )["items"]
            }  # fmt: skip

        # The Events are posted in the background after the change: poll for them.
        wait_for(
            "LeaderElected and LeaderLost Events on the Lease",
            lambda: {"LeaderElected", "LeaderLost"} <= lease_event_reasons(),
            10,
        )
        # kubectl shows who holds the lease.
        out = cluster.cp.kubectl("get", "lease", "-n", cluster.namespace).stdout
        assert "op-b_" in out and "HOLDER" in out
        probe.close()
    finally:
        _finish(a, b)


def test_resumed_leader_order_is_refused_by_the_workers_epoch(
    cluster: Cluster, lease: LeaseReader, tiny_models: dict[str, Path], gpu: Gpu,
    tmp_path: Path,
) -> None:  # fmt: skip
    marker = tmp_path / "stop-before-wake"
    a, b = _pair(cluster, tmp_path, stop_before_wake=marker)
    for op in (a, b):  # the fault point is before a serial WakeUp, after the sleep's ACK
        op.extra.append(SERIAL)
    watch = MemoryWatch(gpu)
    started = False
    try:
        _start_with_leader(cluster, lease, a, b)
        _stages(cluster, tiny_models, gpu.node)
        watcher = Watcher((cluster.cp, cluster.namespace, ["ar", "sd"]))
        watch.__enter__()
        started = True

        # op-a decides the hand-over ar -> sd: ar's sleep is ACKed, the WakeUp of sd passed
        # op-a's last leading() check, and op-a stops right before sending it.
        marker.write_text("armed")
        cluster.patch_state("ar", "Asleep")
        cluster.patch_state("sd", "Active")
        wait_for("op-a stopped at the fault point", a.stopped, 60)
        assert "FAULT POINT: stopping before WakeUp" in a.log.read_text()
        assert "(epoch 1)" in a.log.read_text()

        # op-b takes over (epoch 2), wakes sd, then hands the memory back to ar.
        wait_for("op-b holding the lease", lambda: _leads(lease, b), LEASE_S + 2)
        wait_for("sd Active under op-b", lambda: cluster.state("sd") == "Active", 120)
        cluster.patch_state("sd", "Asleep")
        cluster.patch_state("ar", "Active")
        wait_for("ar Active under op-b", lambda: cluster.state("ar") == "Active", 120)
        wait_for("sd Asleep under op-b", lambda: cluster.state("sd") == "Asleep", 60)

        # op-a resumes and sends the WakeUp it decided before the stop, with epoch 1.
        a.signal(signal.SIGCONT)
        wait_for(
            "op-a's stale WakeUp refused",
            lambda: "FAILED_PRECONDITION" in a.log.read_text(errors="replace"),
            30,
        )
        log = a.log.read_text(errors="replace")
        refusal = next(ln for ln in log.splitlines() if "FAILED_PRECONDITION" in ln)
        assert "epoch 1" in refusal and "epoch 2" in refusal, refusal  # names both epochs
        time.sleep(1.0)  # let any effect of the stale order show in the workers
        history = watcher.stop()
        watch.__exit__(None, None, None)
        started = False

        probe = WorkerProbe(cluster.cp, cluster.namespace, ["ar", "sd"])
        sd, ar = probe.status("sd"), probe.status("ar")
        probe.close()
        assert sd is not None and ar is not None
        assert sd.report.phase is WorkerPhase.ASLEEP, "the stale WakeUp was obeyed"
        assert ar.report.phase is WorkerPhase.ACTIVE
        assert sd.epoch == 2 and ar.epoch == 2
        assert sd.report.last_ack is not None and sd.report.last_ack.op == "sleep"
        assert history.samples > 0
        assert history.overlaps(["ar", "sd"]) == []
        # The device itself, seen from outside: never both stages' weights resident.
        assert watch.samples > 0 and watch.max_sum <= CAPACITY and watch.max_resident == 1
        assert _leads(lease, b) and a.gauge("omnistage_leader") == 0.0
    finally:
        if started:
            watch.__exit__(None, None, None)
        _finish(a, b)
