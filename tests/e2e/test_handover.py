"""ACK-gated hand-overs end to end: real API server, localnode, real workers, the real operator.

Each test uses a fresh node with one simulated GPU of ``CAPACITY`` bytes on which the tiny
diffusion stage fits only alone. The GPU has real physics (driver reserve, a context per worker
process, activations while serving) and no stage sets ``vram.request``: footprints are measured.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from omnistage_operator.decisions.arbiter import WorkerPhase
from tests.e2e.conftest import (
    CAPACITY,
    SERIAL,
    Cluster,
    Gpu,
    OperatorProcess,
    stage_manifest,
    wait_for,
)
from tests.e2e.conftest import TOKEN as _TOKEN

pytestmark = [pytest.mark.timeout(600)]


class MemoryWatch:
    """Samples the simulated GPU from outside (as nvidia-smi would): the most memory its
    processes held at one instant, and the most processes holding weights at once."""

    def __init__(self, gpu: Gpu) -> None:
        self.gpu = gpu
        self.max_sum = 0
        self.max_resident = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            snap = self.gpu.snapshot()
            self.max_sum = max(self.max_sum, snap.device.reserve + snap.used_total)
            resident = sum(1 for p in snap.procs.values() if p.weights > 0)
            self.max_resident = max(self.max_resident, resident)
            self.samples += 1
            time.sleep(0.005)

    def __enter__(self) -> MemoryWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)


def _active_pair(cluster: Cluster, models: dict[str, Path], node: str) -> None:
    cluster.apply(stage_manifest("ar", "ar", models, node, state="Active"))
    cluster.apply(stage_manifest("sd", "sd", models, node, state="Asleep"))
    wait_for("ar Active", lambda: cluster.state("ar") == "Active", 180)
    wait_for("sd Asleep", lambda: cluster.state("sd") == "Asleep", 60)


@pytest.mark.operator_args(SERIAL)
def test_switch_waits_for_the_sleep_ack(
    cluster: Cluster, operator: OperatorProcess, tiny_models: dict[str, Path], gpu: Gpu
) -> None:
    gpu_node = gpu.node
    _active_pair(cluster, tiny_models, gpu_node)
    with MemoryWatch(gpu) as watch:
        cluster.patch_state("sd", "Active")
        wait_for("sd Active", lambda: cluster.state("sd") == "Active", 120)
    ar_status, sd_status = cluster.status("ar"), cluster.status("sd")

    # The AR stage still wants Active but the latest ask took the memory: it waits for sd.
    assert ar_status["state"] == "Waiting"
    assert ar_status["waitingFor"] == ["sd"]
    ack = ar_status["lastAck"]
    assert (ack["op"], ack["ok"], ack["level"]) == ("sleep", True, 1)
    # What stays is the worker's CUDA context, measured at its start: nothing more.
    context = ar_status["memory"]["contextBytes"]
    assert context > 0
    assert ack["freedBytes"] > 0 and ack["usedAfterBytes"] == context
    assert ar_status["memory"]["usedBytes"] == context
    assert sd_status["lastAck"]["op"] == "wake" and sd_status["lastAck"]["ok"] is True

    # The order, from the workers' own ACKs (their clocks, their measurements).
    ar_worker = cluster.worker_status("ar")
    sd_worker = cluster.worker_status("sd")
    assert ar_worker is not None and sd_worker is not None
    assert ar_worker.last_ack is not None and sd_worker.last_ack is not None
    assert ar_worker.last_ack.op == "sleep" and ar_worker.last_ack.ok
    assert sd_worker.last_ack.op == "wake" and sd_worker.last_ack.ok
    assert ar_worker.last_ack.finished_at < sd_worker.last_ack.started_at
    assert ar_worker.phase is WorkerPhase.ASLEEP and sd_worker.phase is WorkerPhase.ACTIVE
    assert watch.samples > 0 and watch.max_sum <= CAPACITY
    assert watch.max_resident == 1  # the two stages' weights were never on the GPU together

    # kubectl get omnistages shows who holds the GPU.
    out = cluster.cp.kubectl("get", "omnistages", "-n", cluster.namespace).stdout
    header, *rows = out.strip().splitlines()
    for col in ("STATE", "LEVEL", "GROUP", "USED", "FREED", "NODE", "AGE"):
        assert col in header
    by_name = {r.split()[0]: r for r in rows}
    assert "Active" in by_name["sd"].split() and "Waiting" in by_name["ar"].split()
    assert gpu_node in by_name["sd"].split()

    # ar's change of state is told in its Waiting Event, not in a StateChanged of its own.
    events = cluster.reasons_include("ar", {"Slept", "Waiting"})
    assert any(e["message"].endswith("; state Active -> Waiting") for e in events), events
    assert "omnistage_fences_total" in operator.metrics()


def test_frozen_sleeper_is_fenced_before_the_wake(
    cluster: Cluster, namespace: str, tmp_path: Path,
    tiny_models: dict[str, Path], gpu_node: str,
) -> None:  # fmt: skip
    op = OperatorProcess(cluster.cp, namespace, tmp_path)
    op.extra = ["--sleep-timeout", "2", "--ack-retries", "2", "--fence-timeout", "60"]
    op.start()
    try:
        _active_pair(cluster, tiny_models, gpu_node)
        pod = cluster.pod("ar")
        assert pod is not None
        old_uid = pod["metadata"]["uid"]
        ar_worker = cluster.worker_status("ar")
        assert ar_worker is not None
        # Freeze the AR worker: it holds its memory and answers nothing (SIGSTOP via its pid).
        pid = _worker_pid(cluster, "ar")
        os.kill(pid, signal.SIGSTOP)
        last_seen = [time.time()]
        stop = threading.Event()

        def watch_pod() -> None:
            while not stop.is_set():
                p = cluster.pod("ar")
                if p is not None and p["metadata"]["uid"] == old_uid:
                    last_seen[0] = time.time()
                time.sleep(0.02)

        watcher = threading.Thread(target=watch_pod, daemon=True)
        watcher.start()
        cluster.patch_state("ar", "Asleep")
        cluster.patch_state("sd", "Active")
        wait_for("sd Active", lambda: cluster.state("sd") == "Active", 180)
        stop.set()
        watcher.join(10)
        sd_worker = cluster.worker_status("sd")
        assert sd_worker is not None and sd_worker.last_ack is not None
        # The wake started only after the frozen worker's pod was last seen in the API.
        assert sd_worker.last_ack.started_at > last_seen[0]
        cluster.reasons_include("ar", {"Fenced"})
        assert 'omnistage_fences_total{group="g1"' in op.metrics()
        conds = {c["type"]: c for c in cluster.status("ar").get("conditions", [])}
        assert conds["MemoryReleased"]["reason"] == "Fenced"
        # The stage gets a fresh pod, created asleep.
        wait_for(
            "a new ar pod",
            lambda: (p := cluster.pod("ar")) is not None and p["metadata"]["uid"] != old_uid,
            60,
        )
    finally:
        op.stop()
        print(op.tail())


def _worker_pid(cluster: Cluster, stage: str) -> int:
    """The worker's pid from its own GetStatus identity."""
    import asyncio

    from omnistage.worker.v1 import sleep_service_pb2, sleep_service_pb2_grpc

    pod = cluster.pod(stage)
    assert pod is not None
    ip = pod["status"]["podIP"]

    async def call() -> int:
        import grpc

        async with grpc.aio.insecure_channel(f"{ip}:50051") as ch:
            stub = sleep_service_pb2_grpc.SleepServiceStub(ch)
            resp = await stub.GetStatus(
                sleep_service_pb2.GetStatusRequest(),
                timeout=5,
                metadata=(("authorization", f"Bearer {_TOKEN}"),),
            )
            return int(resp.worker.pid)

    return asyncio.run(call())


@pytest.mark.parametrize(
    "mode", ["overlapped", pytest.param("serial", marks=pytest.mark.operator_args(SERIAL))]
)
def test_operator_killed_mid_handover_converges(
    mode: str, cluster: Cluster, operator: OperatorProcess, tiny_models: dict[str, Path], gpu: Gpu
) -> None:
    _active_pair(cluster, tiny_models, gpu.node)
    pid = _worker_pid(cluster, "ar")
    # Overlapped: killed with sd's wake under a claim limit no one will raise again; it gives
    # up (the worker's claim wait) and sd is woken by the next leader.
    sent = "overlapped hand-over" if mode == "overlapped" else "level 1 to ar"
    with MemoryWatch(gpu) as watch:
        # Freeze the AR worker so the hand-over is caught with its Sleep sent and no ACK yet.
        os.kill(pid, signal.SIGSTOP)
        try:
            cluster.patch_state("sd", "Active")
            wait_for(
                "the operator sending the sleep to ar",
                lambda: sent in operator.log.read_text(errors="replace"),
                60,
            )
            operator.kill()
        finally:
            os.kill(pid, signal.SIGCONT)
        assert cluster.state("sd") != "Active"
        operator.start()
        wait_for("sd Active after restart", lambda: cluster.state("sd") == "Active", 180)
        wait_for("ar Waiting", lambda: cluster.state("ar") == "Waiting", 60)
    assert watch.samples > 0
    assert watch.max_sum <= CAPACITY, f"holders reached {watch.max_sum} > {CAPACITY}"
    ar_worker = cluster.worker_status("ar")
    sd_worker = cluster.worker_status("sd")
    assert ar_worker is not None and ar_worker.phase is WorkerPhase.ASLEEP
    assert sd_worker is not None and sd_worker.last_ack is not None
    assert ar_worker.last_ack is not None
    if mode == "serial":
        assert watch.max_resident == 1
        assert ar_worker.last_ack.finished_at < sd_worker.last_ack.started_at
