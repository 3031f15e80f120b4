"""DRA: the real scheduler allocates localnode's fake GPUs through resource.k8s.io/v1 claims."""

from __future__ import annotations

import time
from typing import Any

from tests.cluster.controlplane import ControlPlane
from tests.cluster.localnode import LocalNodes
from tests.cluster.podwait import condition, envdump, get_pod, wait_pod
from tests.fakegpu.device import FakeGpu

GiB = 1024**3


def claim(name: str, selector: str | None = None) -> dict[str, Any]:
    exactly: dict[str, Any] = {"deviceClassName": "gpu.nvidia.com"}
    if selector:
        exactly["selectors"] = [{"cel": {"expression": selector}}]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}},
    }


def claim_pod(name: str, claim_name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "terminationGracePeriodSeconds": 5,
            "resourceClaims": [{"name": "gpu", "resourceClaimName": claim_name}],
            "containers": [
                {
                    "name": "main",
                    "image": "ignored",
                    "command": ["python", "-m", "tests.cluster.testpods.envdump", "--sleep"],
                    "resources": {"claims": [{"name": "gpu"}]},
                }
            ],
        },
    }


def test_device_class_and_slices_are_published(
    control_plane: ControlPlane, local_nodes: LocalNodes
) -> None:
    dc = control_plane.get_json("deviceclass", "gpu.nvidia.com")
    assert dc["spec"]["selectors"][0]["cel"]["expression"] == 'device.driver == "gpu.nvidia.com"'
    slices = control_plane.get_json(
        "resourceslices", "--field-selector", "spec.nodeName=gpu-node-0"
    )["items"]
    assert len(slices) == 1
    spec = slices[0]["spec"]
    assert spec["driver"] == "gpu.nvidia.com" and spec["pool"]["name"] == "gpu-node-0"
    assert [d["name"] for d in spec["devices"]] == ["gpu-0", "gpu-1"]
    dev = spec["devices"][1]
    assert dev["attributes"]["type"]["string"] == "gpu" and dev["attributes"]["index"]["int"] == 1
    assert dev["attributes"]["uuid"]["string"].startswith("GPU-")
    assert dev["capacity"]["memory"]["value"] == "80Gi"


def test_shared_claim_puts_two_pods_on_one_gpu_and_impossible_claim_stays_pending(
    control_plane: ControlPlane, local_nodes: LocalNodes, namespace: str
) -> None:
    control_plane.apply(
        [
            claim("shared-gpu"),
            claim_pod("stage-a", "shared-gpu"),
            claim_pod("stage-b", "shared-gpu"),
        ],
        namespace=namespace,
    )
    running = [
        wait_pod(
            control_plane, namespace, n, lambda p: p["status"].get("phase") == "Running", "Running"
        )
        for n in ("stage-a", "stage-b")
    ]
    assert {p["spec"]["nodeName"] for p in running} == {"gpu-node-0"}
    allocated = control_plane.get_json("resourceclaim", "shared-gpu", namespace=namespace)
    results = allocated["status"]["allocation"]["devices"]["results"]
    assert (
        len(results) == 1
        and results[0]["driver"] == "gpu.nvidia.com"
        and results[0]["pool"] == "gpu-node-0"
    )
    device = results[0]["device"]
    reserved = {r["name"] for r in allocated["status"].get("reservedFor") or []}
    assert reserved == {"stage-a", "stage-b"}

    envs = []
    for pod in running:
        deadline = time.monotonic() + 20
        while True:  # the process prints its env right after it starts
            try:
                envs.append(envdump(local_nodes.pod_log(pod, "main"))["env"])
                break
            except AssertionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
    # both pods see the device by the UUID the ResourceSlice publishes, and share its simulation
    slice_ = control_plane.get_json(
        "resourceslices", "--field-selector", "spec.nodeName=gpu-node-0"
    )["items"][0]
    uuid = next(
        d["attributes"]["uuid"]["string"] for d in slice_["spec"]["devices"] if d["name"] == device
    )
    assert [e["NVIDIA_VISIBLE_DEVICES"] for e in envs] == [uuid, uuid]
    assert {e["OMNISTAGE_MEMORY_PROBE"] for e in envs} == {"tests.fakegpu.probe:from_env"}
    gpu_dir = envs[0]["OMNISTAGE_FAKE_GPU"]
    assert gpu_dir == envs[1]["OMNISTAGE_FAKE_GPU"] and gpu_dir.endswith(f"/gpu-node-0/{device}")
    assert "OMNISTAGE_MEMORY_CAPACITY" not in envs[0] and "OMNISTAGE_MEMORY_LEDGER" not in envs[0]
    physics = FakeGpu(gpu_dir).device()
    assert physics.uuid == uuid and physics.total == 80 * GiB
    assert 0 < physics.reserve < physics.context < GiB  # realistic defaults: free < total

    # a device bigger than any that exists: the real scheduler leaves the pod Pending and says why
    too_big = 'device.capacity["gpu.nvidia.com"].memory.compareTo(quantity("1Ti")) > 0'
    control_plane.apply([claim("huge", too_big), claim_pod("greedy", "huge")], namespace=namespace)
    pending = wait_pod(
        control_plane,
        namespace,
        "greedy",
        lambda p: (condition(p, "PodScheduled") or {}).get("reason") == "Unschedulable",
        "reported Unschedulable",
    )
    cond = condition(pending, "PodScheduled")
    assert cond is not None and cond["status"] == "False"
    assert "claim" in cond["message"].lower(), cond["message"]
    print(f"scheduler: {cond['reason']}: {cond['message']}")
    again = get_pod(control_plane, namespace, "greedy")
    assert (
        again is not None
        and not again["spec"].get("nodeName")
        and again["status"]["phase"] == "Pending"
    )
    huge = control_plane.get_json("resourceclaim", "huge", namespace=namespace)
    assert not (huge.get("status") or {}).get("allocation")


def test_claim_from_a_template_gives_the_pod_its_own_gpu(
    control_plane: ControlPlane, local_nodes: LocalNodes, namespace: str
) -> None:
    template = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": "one-gpu"},
        "spec": {"spec": claim("x")["spec"]},
    }
    pod = claim_pod("solo", "unused")
    pod["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}]
    control_plane.apply([template, pod], namespace=namespace)
    running = wait_pod(
        control_plane, namespace, "solo", lambda p: p["status"].get("phase") == "Running", "Running"
    )
    statuses = running["status"]["resourceClaimStatuses"]
    claim_name = statuses[0]["resourceClaimName"]
    allocated = control_plane.get_json("resourceclaim", claim_name, namespace=namespace)
    device = allocated["status"]["allocation"]["devices"]["results"][0]["device"]
    deadline = time.monotonic() + 20
    while True:
        try:
            env = envdump(local_nodes.pod_log(running, "main"))["env"]
            break
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    assert env["NVIDIA_VISIBLE_DEVICES"] == local_nodes.fake_gpu(0, device).device().uuid
