"""The Lease is renewed on time while the operator's event loop is busy (issue 24).

A storm of rounds keeps the operator's event loop busy; the renewals must not wait behind it, or
the leader steps down under exactly the load it must carry. The fault point keeps the loop
computing for several renew deadlines in the middle of a hand-over (after the wake was decided),
as a burst of rounds would; the leader must keep its Lease and epoch throughout.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.conftest import Cluster, stage_manifest, wait_for
from tests.e2e.test_leader_support import ElectedOperator, LeaseReader

pytestmark = [pytest.mark.timeout(600)]

TIMING = (3.0, 2.0, 0.5)  # lease duration, renew deadline, retry period
BUSY_S = 3 * TIMING[1]  # three renew deadlines


def test_a_busy_event_loop_keeps_the_lease_and_epoch(
    cluster: Cluster, tiny_models: dict[str, Path], gpu_node: str, tmp_path: Path
) -> None:
    lease = LeaseReader(cluster.cp, cluster.namespace)
    marker = tmp_path / "busy"
    op = ElectedOperator(
        cluster.cp, cluster.namespace, tmp_path / "op", "op-busy", TIMING,
        busy_before_wake=marker,
    )  # fmt: skip
    try:
        op.start()
        wait_for("op-busy holding the lease", lambda: lease.holder().startswith("op-busy_"), 30)
        cluster.apply(stage_manifest("ar", "ar", tiny_models, gpu_node, state="Active"))
        cluster.apply(stage_manifest("sd", "sd", tiny_models, gpu_node, state="Asleep"))
        wait_for("ar Active", lambda: cluster.state("ar") == "Active", 180)
        wait_for("sd Asleep", lambda: cluster.state("sd") == "Asleep", 60)
        before = lease.get()
        assert before is not None
        holder, transitions = before["spec"]["holderIdentity"], before["spec"]["leaseTransitions"]

        marker.write_text(str(BUSY_S))  # armed: the next WakeUp waits behind a busy loop
        cluster.patch_state("ar", "Asleep")
        cluster.patch_state("sd", "Active")
        wait_for("the fault point fired", lambda: "event loop free again" in op.tail(200), 120)
        wait_for("sd Active", lambda: cluster.state("sd") == "Active", 60)

        log = op.tail(400)
        assert f"event loop busy for {BUSY_S}s" in log
        assert "leadership lost" not in log, log
        after = lease.get()
        assert after is not None
        assert after["spec"]["holderIdentity"] == holder
        assert after["spec"]["leaseTransitions"] == transitions
        assert op.gauge("omnistage_leader") == 1.0
        assert op.gauge("omnistage_leader_epoch") == float(transitions)
        assert 'omnistage_leader_transitions_total{change="lost"}' not in op.metrics()
    finally:
        op.shutdown()
        print(f"--- op-busy log tail ---\n{op.tail(60)}")
        lease.close()
