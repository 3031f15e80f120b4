"""A wake the gate let through that runs out of device memory during its copy (issue 19, item 5).

Real API server, localnode with a simulated GPU, real workers and the real operator. ``sd`` was
never measured Active and sets no ``vram.request``. When it is patched Active, ``ar`` is put to
sleep and the gate opens; then, between the gate and ``sd``'s copy, another tenant (this test
process, fault ``tenant_on_copy``) takes the room. The copy runs out: ``sd`` must be back asleep
with nothing on the device, its status must say why with the figures, and the operator must not
send the wake again while the tenant holds the room; once the tenant leaves, ``sd`` wakes.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import Cluster, Gpu, wait_for
from tests.e2e.test_handover import _worker_pid
from tests.e2e.test_physics import _conditions, _operator, _pair

pytestmark = [pytest.mark.timeout(600)]


def test_a_wake_out_of_memory_mid_copy_is_charged_said_and_not_resent(
    cluster: Cluster, namespace: str, tmp_path: Path, tiny_models: dict[str, Path], gpu: Gpu
) -> None:
    op = _operator(cluster, namespace, tmp_path)
    me = os.getpid()
    try:
        _pair(cluster, tiny_models, gpu.node)
        ar_pid, sd_pid = _worker_pid(cluster, "ar"), _worker_pid(cluster, "sd")
        snap = gpu.snapshot()
        ar = snap.procs[ar_pid]
        free_with_ar_asleep = snap.free + ar.charged - ar.context
        sd = cluster.worker_status("sd")
        assert sd is not None and sd.weights_bytes > 0
        tenant = free_with_ar_asleep - sd.weights_bytes // 2  # half of sd's weights fit
        gpu.nodes.fake_gpu(gpu.node, gpu.device).set_faults(sd_pid, tenant_on_copy=[me, tenant])
        cluster.patch_state("sd", "Active")

        def oom_said() -> dict[str, object] | None:
            ready = _conditions(cluster, "sd").get("Ready") or {}
            return ready if ready.get("reason") == "WakeOutOfMemory" else None

        ready = wait_for("sd's Ready to say WakeOutOfMemory", oom_said, 180)
        message = str(ready["message"])
        assert "ran out of device memory" in message and "needed" in message, message
        events = cluster.reasons_include("sd", {"WakeOutOfMemory"})
        assert any("needed" in e.get("message", "") for e in events)
        rep = cluster.worker_status("sd")
        assert rep is not None and rep.phase.value == "Asleep" and rep.last_ack is not None
        failed = rep.last_ack
        assert failed.op == "wake" and not failed.ok and failed.needed_bytes > 0
        # nothing of the wake left on the device: sd holds its context only
        assert gpu.snapshot().procs[sd_pid].charged == gpu.snapshot().procs[sd_pid].context
        assert f"needed {failed.needed_bytes} bytes more" in message
        status = cluster.status("sd")
        assert status.get("learnedNeedBytes", 0) >= failed.needed_bytes
        # While the tenant holds the room, the wake is not sent again (rounds keep running:
        # the back-off is 1 s, then the gate waits for free memory that covers the need).
        time.sleep(8)
        again = cluster.worker_status("sd")
        assert again is not None and again.last_ack is not None
        assert again.last_ack.task_id == failed.task_id, "the wake was sent again"
        assert cluster.state("sd") != "Active"
        gpu.nodes.fake_gpu(gpu.node, gpu.device).withdraw(me)  # the tenant leaves
        wait_for("sd Active once the room is back", lambda: cluster.state("sd") == "Active", 120)
        woke = cluster.worker_status("sd")
        assert woke is not None and woke.last_ack is not None and woke.last_ack.ok
        assert oom_said() is None
    finally:
        gpu.nodes.fake_gpu(gpu.node, gpu.device).withdraw(me)
        op.stop()
        print(op.tail())
