"""A restarted operator keeps what the last one learned (issue 19, left open): the back-off after
a wake that ran out of device memory, and an OnDemand stage's patch to ``state: Asleep``.

Real API server, localnode with a simulated GPU, real workers; the operator is SIGKILLed (a
crash: nothing is cleaned up) and a new process started. Before, both lived only in the old
process's memory: the back-off started again from its first step, and a stage patched Asleep
while no operator ran stayed Active for its whole residency.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.e2e.conftest import Cluster, Gpu, OperatorProcess, stage_manifest, wait_for
from tests.e2e.test_handover import _worker_pid
from tests.e2e.test_ondemand import on_demand
from tests.e2e.test_physics import _conditions, _operator, _pair

pytestmark = [pytest.mark.timeout(600)]


def _second(tmp_path: Path) -> Path:
    (tmp_path / "second").mkdir(exist_ok=True)
    return tmp_path / "second"


def _oom_attempts(cluster: Cluster, stage: str) -> int:
    return int((cluster.status(stage).get("wakeBackoff") or {}).get("attempts") or 0)


def test_the_wake_back_off_continues_after_a_restart(
    cluster: Cluster, namespace: str, tmp_path: Path, tiny_models: dict[str, Path], gpu: Gpu
) -> None:
    op = _operator(cluster, namespace, tmp_path)
    me = os.getpid()
    fake = gpu.nodes.fake_gpu(gpu.node, gpu.device)
    try:
        _pair(cluster, tiny_models, gpu.node)
        ar_pid, sd_pid = _worker_pid(cluster, "ar"), _worker_pid(cluster, "sd")
        snap = gpu.snapshot()
        ar = snap.procs[ar_pid]
        free_with_ar_asleep = snap.free + ar.charged - ar.context
        sd = cluster.worker_status("sd")
        assert sd is not None and sd.weights_bytes > 0
        tenant = free_with_ar_asleep - sd.weights_bytes // 2  # half of sd's weights fit
        fake.set_faults(sd_pid, tenant_on_copy=[me, tenant])
        cluster.patch_state("sd", "Active")
        wait_for("sd's first wake out of memory", lambda: _oom_attempts(cluster, "sd") == 1, 180)
        first = cluster.status("sd")["wakeBackoff"]
        rep = cluster.worker_status("sd")
        assert rep is not None and rep.last_ack is not None
        assert first["neededBytes"] == rep.last_ack.needed_bytes > 0 and first["until"]

        op.kill()  # a crash, right after the first wake out of memory
        fake.withdraw(me)  # the room comes back ...
        fake.set_faults(sd_pid, tenant_on_copy=[me, tenant])  # ... and goes at the next copy
        op = _operator(cluster, namespace, _second(tmp_path))
        # The new process's gate opens (the room is measured back) and the copy runs out again:
        # the second wake out of memory in a row backs off 2 s (it restarted from 1 s before).
        wait_for("sd's second wake out of memory", lambda: _oom_attempts(cluster, "sd") >= 2, 180)
        assert _oom_attempts(cluster, "sd") == 2
        ready = _conditions(cluster, "sd").get("Ready") or {}
        assert ready.get("reason") == "WakeOutOfMemory" and "no wake for 2s" in ready["message"]
        fake.withdraw(me)
        wait_for("sd Active once the room is back", lambda: cluster.state("sd") == "Active", 120)
        wait_for("the back-off cleared", lambda: not cluster.status("sd").get("wakeBackoff"), 30)
    finally:
        fake.withdraw(me)
        op.stop()
        print(op.tail())


def test_a_patch_to_asleep_made_while_no_operator_ran_is_honoured(
    cluster: Cluster, namespace: str, tmp_path: Path, tiny_models: dict[str, Path], gpu: Gpu
) -> None:
    op: OperatorProcess = _operator(cluster, namespace, tmp_path)
    try:
        manifest = stage_manifest("ar", "ar", tiny_models, gpu.node, vram_request="600k")
        cluster.apply(on_demand(manifest, minResidency="1h"))  # no idleAfter: never idle
        wait_for("ar Active", lambda: cluster.state("ar") == "Active", 180)
        wait_for("ar Manual", lambda: cluster.status("ar").get("awakeReason") == "Manual", 30)
        op.kill()
        cluster.patch_state("ar", "Asleep")  # while no operator runs
        op = _operator(cluster, namespace, _second(tmp_path))
        wait_for("ar Asleep after the restart", lambda: cluster.state("ar") == "Asleep", 60)
        rep = cluster.worker_status("ar")
        assert rep is not None and rep.last_ack is not None
        assert rep.last_ack.op == "sleep" and rep.last_ack.ok
        wait_for("asleepAskedAt cleared", lambda: not cluster.status("ar").get("asleepAskedAt"))
    finally:
        op.stop()
        print(op.tail())
