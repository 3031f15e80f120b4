"""An overlapped hand-over end to end (``--overlapped-handover``): real API server, localnode,
real workers on one simulated GPU on which the tiny diffusion stage fits only alone, the real
operator.

The round sends the sleeper's ``SleepStream`` and the next stage's ``WakeUp`` under a claim limit
at once, raising the limit as the sleep reports memory released: the wake is under way before
the sleep's ACK, and the GPU, sampled from outside, never holds more than its capacity. Without
the flag the wake follows the ACK (``test_handover``'s ``test_switch_waits_for_the_sleep_ack``).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from omnistage_operator.decisions.arbiter import WorkerPhase
from omnistage_operator.decisions.handover.overlap import handoff_channel
from tests.e2e.conftest import CAPACITY, Cluster, Gpu, wait_for
from tests.e2e.handover_counting import resting_pair
from tests.e2e.test_handover import MemoryWatch

pytestmark = [pytest.mark.timeout(600)]


def test_the_wake_runs_beside_the_sleep_and_the_gpu_never_holds_both(
    cluster: Cluster, tiny_models: dict[str, Path], gpu: Gpu, tmp_path: Path
) -> None:
    with resting_pair(cluster, tiny_models, gpu, tmp_path, ["--overlapped-handover"]) as op:
        with MemoryWatch(gpu) as watch:
            cluster.patch_state("sd", "Active")
            wait_for("sd Active", lambda: cluster.state("sd") == "Active", 120)
            wait_for("ar Waiting", lambda: cluster.state("ar") == "Waiting", 30)
        log = op.log.read_text()

    ar_status, sd_status = cluster.status("ar"), cluster.status("sd")
    ack = ar_status["lastAck"]
    assert (ack["op"], ack["ok"], ack["level"]) == ("sleep", True, 1)
    assert ack["usedAfterBytes"] == ar_status["memory"]["contextBytes"]
    assert sd_status["lastAck"]["op"] == "wake" and sd_status["lastAck"]["ok"] is True
    assert "overlapped hand-over" in log and "ar sleeps while sd wakes" in log, log[-4000:]

    ar_worker, sd_worker = cluster.worker_status("ar"), cluster.worker_status("sd")
    assert ar_worker is not None and sd_worker is not None
    assert ar_worker.last_ack is not None and sd_worker.last_ack is not None
    assert ar_worker.last_ack.op == "sleep" and sd_worker.last_ack.op == "wake"
    assert ar_worker.phase is WorkerPhase.ASLEEP and sd_worker.phase is WorkerPhase.ACTIVE
    # sd was woken by the wake beside ar's sleep, not by a wake after it.
    assert sd_worker.last_ack.task_id.endswith("-sd-wake-beside"), sd_worker.last_ack.task_id
    # The wake went out before the sleep's ACK came back (serially it goes out after it).
    sent = log.index(f"wake {sd_worker.last_ack.task_id}: to sd under a claim limit")
    acked = log.index(f"sleep {ar_worker.last_ack.task_id} of ar: ACK ok")
    assert sent < acked, log[-4000:]
    gap = ar_worker.last_ack.finished_at - sd_worker.last_ack.started_at
    print(f"sd's wake began {gap * 1000:.1f} ms before ar's sleep ended (workers' clocks)")
    # sd may take its weights into the room beside ar while ar still holds its own (its
    # footprint, activations included, would not fit beside ar's: ar had to sleep), but the
    # device, sampled from outside, never holds more than it has.
    assert watch.samples > 0 and watch.max_sum <= CAPACITY


def test_workers_sharing_a_handoff_directory_get_a_channel_for_the_wake(
    cluster: Cluster,
    tiny_models: dict[str, Path],
    gpu: Gpu,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    """With ``--handoff-host-path`` the group's pods share ``<path>/<namespace>/<group>`` (a
    hostPath), both workers say so (``GetStatus.handoff``), and the overlapped hand-over names
    one channel for the sleep and the wake beside it; the wake's socket is gone once it ended.
    (On the CPU the flat buffer is one allocation: no piece crosses; the GPU run of the same
    RPCs is ``bench/overlap.py --handoff``.)"""
    base = Path(tempfile.mkdtemp(prefix="ho", dir="/tmp"))  # a socket's path holds 107 bytes
    request.addfinalizer(lambda: shutil.rmtree(base, ignore_errors=True))
    flags = ["--overlapped-handover", f"--handoff-host-path={base}"]
    with resting_pair(cluster, tiny_models, gpu, tmp_path, flags) as op:
        ar_worker, sd_worker = cluster.worker_status("ar"), cluster.worker_status("sd")
        assert ar_worker is not None and sd_worker is not None
        assert ar_worker.handoff and sd_worker.handoff
        cluster.patch_state("sd", "Active")
        wait_for("sd Active", lambda: cluster.state("sd") == "Active", 120)
        log = op.log.read_text()
    sd_worker = cluster.worker_status("sd")
    assert sd_worker is not None and sd_worker.last_ack is not None
    wake_id = sd_worker.last_ack.task_id
    assert wake_id.endswith("-sd-wake-beside"), wake_id
    channel = handoff_channel(wake_id)
    assert f"pieces handed over on {channel}" in log, log[-4000:]
    shared = base / cluster.namespace / "g1"
    assert shared.is_dir() and not (shared / f"{channel}.sock").exists()
