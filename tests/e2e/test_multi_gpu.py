"""Two stages of ``gpus: 2`` handing a 2-GPU node over, end to end.

A localnode node with two simulated GPUs (each its own capacity, free memory and UUID, both in
the ResourceSlice); the group's claim gets both; each stage's worker (``--gpus 2``, CPU torch)
splits its tiny Llama over the two devices and measures each through its own simulated GPU.
Per device, one stage's share fits and two do not, so the hand-over must put one to sleep
(acked on both devices) before the other wakes.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.localnode import LocalNodes
from tests.e2e.conftest import Cluster, OperatorProcess, stage_manifest, wait_for

pytestmark = [pytest.mark.timeout(600)]

# Per device: the tiny Llama (~81 KiB) puts ~41 KiB on each device, ~51 KiB while serving;
# one stage plus the wake margin fits, two do not.
PER_DEVICE = 80_000
DEVICES = ("gpu-0", "gpu-1")


class ResidentWatch:
    """Samples both simulated GPUs from outside: the most processes with weights on one device."""

    def __init__(self, nodes: LocalNodes, node: str) -> None:
        self.nodes, self.node = nodes, node
        self.max_resident = dict.fromkeys(DEVICES, 0)
        self.max_charged = dict.fromkeys(DEVICES, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for device in DEVICES:
                snap = self.nodes.device_snapshot(self.node, device)
                resident = sum(1 for p in snap.procs.values() if p.weights > 0)
                self.max_resident[device] = max(self.max_resident[device], resident)
                charged = snap.device.reserve + snap.used_total
                self.max_charged[device] = max(self.max_charged[device], charged)
            time.sleep(0.005)

    def __enter__(self) -> ResidentWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)


def two_gpu_stage(name: str, models: dict[str, Path], node: str, state: str) -> dict[str, Any]:
    manifest = stage_manifest(
        name, "ar", models, node, state=state, worker_args=["--cpu-threads=1"]
    )
    manifest["spec"]["gpus"] = 2
    return manifest


def test_two_2gpu_stages_hand_over_per_device(
    cluster: Cluster,
    operator: OperatorProcess,
    tiny_models: dict[str, Path],
    make_local_nodes: Any,
) -> None:
    nodes: LocalNodes = make_local_nodes(nodes=1, gpus=2, gpu_memory=PER_DEVICE)
    node = nodes.node_names[0]
    uuids = {d: nodes.fake_gpu(node, d).device().uuid for d in DEVICES}
    assert len(set(uuids.values())) == 2  # each GPU is its own device

    cluster.apply(two_gpu_stage("a", tiny_models, node, "Active"))
    cluster.apply(two_gpu_stage("b", tiny_models, node, "Asleep"))
    wait_for("a Active", lambda: cluster.state("a") == "Active", 240)
    wait_for("b Asleep", lambda: cluster.state("b") == "Asleep", 120)
    status = cluster.status("a")
    assert sorted(d["uuid"] for d in status["devices"]) == sorted(uuids.values())
    for device in DEVICES:  # a's weights are on both devices
        snap = nodes.device_snapshot(node, device)
        assert sum(1 for p in snap.procs.values() if p.weights > 0) == 1

    with ResidentWatch(nodes, node) as watch:
        cluster.patch_state("b", "Active")
        wait_for("b Active", lambda: cluster.state("b") == "Active", 180)
        wait_for("a Waiting", lambda: cluster.state("a") == "Waiting", 60)
        cluster.patch_state("b", "Asleep")  # a still asks for Active: it gets the GPUs back
        wait_for("a Active again", lambda: cluster.state("a") == "Active", 180)
        wait_for("b Asleep", lambda: cluster.state("b") == "Asleep", 60)

    # On each device the two stages' weights were never resident together, and the device
    # was never over its capacity.
    assert watch.max_resident == dict.fromkeys(DEVICES, 1)
    assert all(watch.max_charged[d] <= PER_DEVICE for d in DEVICES)
    b = cluster.status("b")
    ack = b["lastAck"]
    assert (ack["op"], ack["ok"]) == ("sleep", True)
    assert sorted(d["uuid"] for d in b["devices"]) == sorted(uuids.values())
    worker = cluster.worker_status("b")
    assert worker is not None and worker.last_ack is not None
    # the sleep ACK names both devices, and each gave its share back
    freed = {d.uuid: d.used_before - d.used_after for d in worker.last_ack.devices}
    assert set(freed) == set(uuids.values()) and all(v > 0 for v in freed.values())


def test_a_stage_wider_than_the_claim_is_refused_and_gets_no_pod(
    cluster: Cluster,
    operator: OperatorProcess,
    tiny_models: dict[str, Path],
    make_local_nodes: Any,
) -> None:
    nodes: LocalNodes = make_local_nodes(nodes=1, gpus=2, gpu_memory=4 * PER_DEVICE)
    node = nodes.node_names[0]
    one = stage_manifest("one", "ar", tiny_models, node, worker_args=["--cpu-threads=1"])
    cluster.apply(one)  # the group's claim is sized for it: one GPU
    wait_for("one Active", lambda: cluster.state("one") == "Active", 240)
    cluster.apply(two_gpu_stage("wide", tiny_models, node, "Active"))

    def refused() -> dict[str, Any] | None:
        conditions = cluster.status("wide").get("conditions") or []
        admitted = next((c for c in conditions if c["type"] == "Admitted"), None)
        return admitted if admitted and admitted["reason"] == "ClaimTooSmall" else None

    admitted = wait_for("wide refused with ClaimTooSmall", refused, 60)
    assert admitted["status"] == "False" and "needs 2 GPUs" in admitted["message"]
    assert cluster.pod("wide") is None  # no pod on a claim that cannot hold it
    assert cluster.state("one") == "Active"  # the running stage is left alone
