"""Real ``omnistage-worker`` processes on one simulated GPU, driven over gRPC.

First without a control plane: two worker subprocesses get ``OMNISTAGE_MEMORY_PROBE`` and
``OMNISTAGE_FAKE_GPU`` as localnode gives them, and their own figures must show the device's
physics: a context before any weights, free below total when idle, a serving peak that stays
until the sleep, each other's memory, and the leak and lie faults. Then as a localnode pod,
with the faults switched through ``LocalNodes``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest

from omnistage.worker.v1 import (
    inference_service_pb2,
    inference_service_pb2_grpc,
    sleep_service_pb2,
    sleep_service_pb2_grpc,
    types_pb2,
)
from tests.cluster.controlplane import ControlPlane
from tests.cluster.localnode import LocalNodes
from tests.cluster.podwait import wait_gone, wait_pod
from tests.fakegpu.device import FakeGpu
from tests.fakegpu.model import Device, MiB
from tests.worker.tiny_models import build_causal_lm

pytestmark = [pytest.mark.timeout(300)]
T = TypeVar("T")
KiB = 1024
LEAK = 16 * KiB
WORKER_ARGS = [
    "--runner", "ar", "--backend", "transformers", "--model", "/models/m",
    "--host", "$(POD_IP)", "--port", "50051",
]  # fmt: skip


def wait_for(what: str, check: Callable[[], T | None], timeout: float = 180.0) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


class Worker:
    """One worker subprocess on the simulated GPU, with sync gRPC stubs."""

    def __init__(self, model: Path, gpu: Path, log: Path, *extra: str) -> None:
        env = {
            **os.environ,
            "OMNISTAGE_CPU_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "OMNISTAGE_MEMORY_PROBE": "tests.fakegpu.probe:from_env",
            "OMNISTAGE_FAKE_GPU": str(gpu),
        }
        env.pop("OMNISTAGE_MEMORY_CAPACITY", None)
        env.pop("OMNISTAGE_MEMORY_LEDGER", None)
        argv = [
            sys.executable, "-m", "omnistage_worker", "--runner", "ar", "--backend",
            "transformers", "--model", str(model), "--host", "127.0.0.1", "--port", "0",
            "--residual-slack", "4096", *extra,
        ]  # fmt: skip
        self.log = log
        self._fh = log.open("w")
        self.proc = subprocess.Popen(argv, stdout=self._fh, stderr=subprocess.STDOUT, env=env)
        port = wait_for("the worker to listen", self._port)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.sleep_stub = sleep_service_pb2_grpc.SleepServiceStub(self.channel)
        self.infer = inference_service_pb2_grpc.InferenceServiceStub(self.channel)

    def _port(self) -> int | None:
        match = re.search(r"listening on [\d.]+:(\d+)", self.log.read_text())
        if match:
            return int(match.group(1))
        if self.proc.poll() is not None:
            raise AssertionError(f"worker exited:\n{self.log.read_text()}")
        return None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def status(self) -> Any:
        return self.sleep_stub.GetStatus(sleep_service_pb2.GetStatusRequest(), timeout=10)

    def loaded(self, state: int) -> Any:
        return wait_for("the worker to load", lambda: self.status().state == state or None)

    def sleep(self) -> Any:
        req = sleep_service_pb2.SleepRequest(task_id=uuid.uuid4().hex, level=1)  # type: ignore[arg-type]
        return self.sleep_stub.Sleep(req, timeout=60).ack

    def wake(self) -> Any:
        req = sleep_service_pb2.WakeUpRequest(task_id=uuid.uuid4().hex)
        return self.sleep_stub.WakeUp(req, timeout=60).ack

    def generate(self) -> Any:
        req = inference_service_pb2.GenerateRequest(prompt="the cat", max_new_tokens=2)
        return self.infer.Generate(req, timeout=60)

    def stop(self) -> None:
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._fh.close()


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[list[Worker]]:
    started: list[Worker] = []
    yield started
    for w in started:
        w.stop()


def test_worker_figures_follow_the_simulated_device(tmp_path: Path, workers: list[Worker]) -> None:
    model = build_causal_lm(tmp_path / "lm")
    device = Device(uuid="GPU-fake-0", total=16 * MiB)  # defaults: reserve, context, 25%
    gpu = FakeGpu.create(tmp_path / "gpu", device)
    assert gpu.snapshot().free == device.total - device.reserve < device.total

    b = Worker(model, gpu.dir, tmp_path / "b.log", "--initial-state", "asleep")
    workers.append(b)
    b.loaded(types_pb2.WORKER_STATE_ASLEEP)
    idle = b.status()
    # asleep, no weights on the device, yet its context is charged and every process sees it
    assert idle.used_bytes == device.context and idle.weights_bytes > 0
    assert idle.free_bytes == device.total - device.reserve - device.context
    assert idle.devices[0].uuid == "GPU-fake-0" and idle.total_bytes == device.total

    a = Worker(model, gpu.dir, tmp_path / "a.log")
    workers.append(a)
    a.loaded(types_pb2.WORKER_STATE_ACTIVE)
    awake = a.status()
    weights = awake.used_bytes - device.context
    assert weights > 0
    # the second process's figures include the first's context and weights
    assert b.status().free_bytes == device.total - device.reserve - 2 * device.context - weights

    a.generate()
    peak = a.status().used_bytes
    activations = device.activation_bytes(weights)
    assert peak == awake.used_bytes + activations > awake.used_bytes  # kept after the request
    assert b.status().free_bytes == awake.free_bytes - activations

    ack = a.sleep()
    assert ack.ok, ack.error
    assert ack.used_before_bytes == peak and ack.used_after_bytes == device.context
    assert b.status().free_bytes == device.total - device.reserve - 2 * device.context

    # lie: the leaked bytes stay on the device, the liar's own figure (and Ack) omit them
    gpu.set_faults(pid=a.pid, leak_on_sleep=LEAK, lie=True)
    assert a.wake().ok
    a.generate()
    lied = a.sleep()
    assert lied.ok and lied.used_after_bytes == device.context
    clean = device.total - device.reserve - 2 * device.context
    assert b.status().free_bytes == clean - LEAK  # only the device's free memory tells
    assert lied.free_after_bytes == clean - LEAK

    # leak: a sleep that leaves memory behind, in the process's own figure: the Ack is not ok
    gpu.set_faults(pid=a.pid, lie=False)
    assert a.wake().ok
    a.generate()
    leaked = a.sleep()
    assert leaked.used_after_bytes == device.context + LEAK
    assert not leaked.ok and leaked.error
    assert b.status().free_bytes == clean - 2 * LEAK

    # a killed process's memory is freed, as the driver frees it
    a.stop()
    wait_for("A's memory to vanish", lambda: b.status().free_bytes == clean + device.context)


def test_worker_pod_on_localnode_measures_its_simulated_gpu(
    control_plane: ControlPlane, local_nodes: LocalNodes, namespace: str, tmp_path: Path
) -> None:
    """A worker pod placed on gpu-1 sees that device (its UUID, its physics) and its faults."""
    model = build_causal_lm(tmp_path / "lm")
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "worker"},
        "spec": {
            "terminationGracePeriodSeconds": 5,
            "volumes": [{"name": "model", "hostPath": {"path": str(model)}}],
            "containers": [
                {
                    "name": "worker",
                    "image": "ignored",
                    "command": ["omnistage-worker"],
                    "args": WORKER_ARGS,
                    "env": [
                        {
                            "name": "POD_IP",
                            "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
                        },
                        {"name": "NVIDIA_VISIBLE_DEVICES", "value": "gpu-1"},
                        {"name": "OMNISTAGE_CPU_THREADS", "value": "1"},
                    ],
                    "volumeMounts": [{"name": "model", "mountPath": "/models/m"}],
                }
            ],
        },
    }
    control_plane.apply(pod, namespace=namespace)

    def started(p: dict[str, Any]) -> bool:
        statuses = p["status"].get("containerStatuses") or [{}]
        return bool(p["status"].get("podIP")) and "running" in (statuses[0].get("state") or {})

    running = wait_pod(control_plane, namespace, "worker", started, "running", timeout=90)
    pid = int(running["status"]["containerStatuses"][0]["containerID"].split("://")[1])
    gpu = local_nodes.fake_gpu(0, "gpu-1")
    device = gpu.device()
    with grpc.insecure_channel(f"{running['status']['podIP']}:50051") as channel:
        stub = sleep_service_pb2_grpc.SleepServiceStub(channel)

        def status() -> Any:
            try:
                return stub.GetStatus(sleep_service_pb2.GetStatusRequest(), timeout=5)
            except grpc.RpcError:
                return None

        active = wait_for(
            "the worker Active",  # loading competes for 2 shared cores: be patient
            lambda: (s := status()) is not None and s.state == types_pb2.WORKER_STATE_ACTIVE and s,
            180,
        )
        assert active.devices[0].uuid == device.uuid  # the ResourceSlice's UUID for gpu-1
        weights = active.used_bytes - device.context
        assert weights > 0 and active.total_bytes == device.total
        seen = local_nodes.device_snapshot(0, "gpu-1")  # the device seen from outside
        assert seen.procs[pid].used == active.used_bytes
        assert active.free_bytes == seen.free == device.total - device.reserve - active.used_bytes

        local_nodes.device_faults(0, "gpu-1", pid=pid, leak_on_sleep="all", lie=True)
        try:
            req = sleep_service_pb2.SleepRequest(task_id=uuid.uuid4().hex, level=1)  # type: ignore[arg-type]
            ack = stub.Sleep(req, timeout=60).ack
        finally:
            local_nodes.clear_device_faults(0, "gpu-1")
        # the ACK says all is free; only the device's free memory shows the weights still held
        assert ack.ok and ack.used_after_bytes == device.context
        assert local_nodes.device_snapshot(0, "gpu-1").free == seen.free
    control_plane.kubectl("delete", "pod", "worker", "-n", namespace, "--wait=false")
    wait_gone(control_plane, namespace, "worker", timeout=30)
    assert pid not in local_nodes.device_snapshot(0, "gpu-1").procs  # the driver freed it
