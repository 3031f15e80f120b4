"""Pure logic for fake GPU nodes: Node, ResourceSlice and DeviceClass manifests, device choice.

Names follow the NVIDIA DRA driver: driver and DeviceClass ``gpu.nvidia.com``; each node
publishes one pool named after the node with devices ``gpu-0``, ``gpu-1``, ... carrying the
attributes ``type`` ("gpu"), ``uuid``, ``index`` and ``productName`` and the capacity
``memory`` (bytes).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DRIVER = "gpu.nvidia.com"
DEVICE_CLASS = "gpu.nvidia.com"
GPU_RESOURCE = "nvidia.com/gpu"
NODE_LABEL = "localnode.omnistage.io/node"
K8S_VERSION = "v1.36.3"
GiB = 1024**3


@dataclass(frozen=True)
class NodeSpec:
    """One fake GPU node."""

    name: str
    index: int
    gpus: int = 2
    gpu_memory: int = 80 * GiB
    cpu: str = "16"
    memory: str = "64Gi"
    pods: int = 110
    address: str = "127.10.0.1"

    def device_names(self) -> list[str]:
        """``gpu-0`` .. ``gpu-(G-1)``."""
        return [f"gpu-{i}" for i in range(self.gpus)]

    def device_uuid(self, device: str) -> str:
        """A stable fake UUID for ``device`` on this node."""
        return "GPU-" + str(uuid.uuid5(uuid.NAMESPACE_DNS, f"{self.name}.{device}.localnode"))


def quantity(n: int) -> str:
    """Bytes as a canonical Kubernetes quantity (``80Gi``, ``512Mi``, ``1000``)."""
    for suffix, unit in (("Ti", 1024**4), ("Gi", GiB), ("Mi", 1024**2), ("Ki", 1024)):
        if n and n % unit == 0:
            return f"{n // unit}{suffix}"
    return str(n)


def node_manifest(node: NodeSpec) -> dict[str, Any]:
    """The Node object (metadata and spec) as a kubelet registers it."""
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": node.name,
            "labels": {
                "kubernetes.io/hostname": node.name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "nvidia.com/gpu.present": "true",
                NODE_LABEL: "true",
            },
        },
        "spec": {},
    }


def node_status(node: NodeSpec, now: str) -> dict[str, Any]:
    """A Ready node status with capacity, addresses and fresh heartbeats."""
    resources = {
        "cpu": node.cpu,
        "memory": node.memory,
        "pods": str(node.pods),
        "ephemeral-storage": "100Gi",
        GPU_RESOURCE: str(node.gpus),
    }

    def cond(type_: str, status: str, reason: str) -> dict[str, str]:
        return {
            "type": type_,
            "status": status,
            "reason": reason,
            "message": f"localnode: {reason}",
            "lastHeartbeatTime": now,
            "lastTransitionTime": now,
        }

    return {
        "capacity": resources,
        "allocatable": resources,
        "conditions": [
            cond("MemoryPressure", "False", "KubeletHasSufficientMemory"),
            cond("DiskPressure", "False", "KubeletHasNoDiskPressure"),
            cond("PIDPressure", "False", "KubeletHasSufficientPID"),
            cond("Ready", "True", "KubeletReady"),
        ],
        "addresses": [
            {"type": "InternalIP", "address": node.address},
            {"type": "Hostname", "address": node.name},
        ],
        "nodeInfo": {
            "machineID": node.name,
            "systemUUID": node.name,
            "bootID": node.name,
            "kernelVersion": "localnode",
            "osImage": "localnode",
            "containerRuntimeVersion": "localnode://1",
            "kubeletVersion": K8S_VERSION,
            "kubeProxyVersion": "",
            "operatingSystem": "linux",
            "architecture": "amd64",
        },
        "daemonEndpoints": {"kubeletEndpoint": {"Port": 0}},
    }


def resource_slice(node: NodeSpec, node_uid: str, generation: int = 1) -> dict[str, Any]:
    """The node's ResourceSlice (resource.k8s.io/v1), owned by its Node."""
    devices = [
        {
            "name": dev,
            "attributes": {
                "type": {"string": "gpu"},
                "uuid": {"string": node.device_uuid(dev)},
                "index": {"int": i},
                "productName": {"string": f"Fake GPU {node.gpu_memory // GiB}GiB"},
            },
            "capacity": {"memory": {"value": quantity(node.gpu_memory)}},
        }
        for i, dev in enumerate(node.device_names())
    ]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {
            "name": f"{node.name}-{DRIVER}",
            "ownerReferences": [
                {
                    "apiVersion": "v1",
                    "kind": "Node",
                    "name": node.name,
                    "uid": node_uid,
                    "controller": True,
                }
            ],
        },
        "spec": {
            "driver": DRIVER,
            "nodeName": node.name,
            "pool": {"name": node.name, "generation": generation, "resourceSliceCount": 1},
            "devices": devices,
        },
    }


def device_class() -> dict[str, Any]:
    """The DeviceClass selecting every device of the driver."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": DEVICE_CLASS},
        "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}]},
    }


def claim_devices(claim: dict[str, Any], node: str, requests: list[str] | None = None) -> list[str]:
    """Devices of ``claim`` allocated on ``node`` by our driver (optionally only ``requests``).

    A request name in ``requests`` also matches subrequest results (``req/sub``).
    """
    results = (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get(
        "results"
    ) or []
    out = []
    for r in results:
        if r.get("driver") != DRIVER or r.get("pool") != node:
            continue
        if requests and r.get("request", "").split("/")[0] not in requests:
            continue
        out.append(str(r["device"]))
    return out


def parse_visible_devices(value: str, node: NodeSpec) -> list[str]:
    """Parse an explicit ``NVIDIA_VISIBLE_DEVICES`` (``gpu-0,gpu-1`` or ``0,1``; ``all``).

    Raises ValueError naming a device this node does not have.
    """
    value = value.strip()
    if value in ("", "none", "void"):
        return []
    names = node.device_names()
    if value == "all":
        return names
    out = []
    for part in (p.strip() for p in value.split(",")):
        if not part:
            continue
        dev = f"gpu-{part}" if part.isdigit() else part
        if dev not in names:
            raise ValueError(
                f"NVIDIA_VISIBLE_DEVICES names {part!r}, which node {node.name} "
                f"does not have ({', '.join(names)})"
            )
        out.append(dev)
    return out


def sort_devices(devices: list[str]) -> list[str]:
    """Unique devices in index order."""

    def key(d: str) -> tuple[int, str]:
        tail = d.rsplit("-", 1)[-1]
        return (int(tail) if tail.isdigit() else 1 << 30, d)

    return sorted(set(devices), key=key)


def gpu_env(node: NodeSpec, devices: list[str], state_dir: Path) -> dict[str, str]:
    """The fake GPU environment for a container that got ``devices`` (empty: none).

    The ledger directory is named here; the caller creates it.
    """
    if not devices:
        return {}
    devs = sort_devices(devices)
    ledger = state_dir / "ledger" / node.name / "+".join(devs)
    return {
        "NVIDIA_VISIBLE_DEVICES": ",".join(devs),
        "OMNISTAGE_MEMORY_CAPACITY": str(node.gpu_memory * len(devs)),
        "OMNISTAGE_MEMORY_LEDGER": str(ledger),
    }
