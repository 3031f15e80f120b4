"""Pure logic for GPU nodes: Node, ResourceSlice and DeviceClass manifests, device choice.

Names follow the NVIDIA DRA driver: driver and DeviceClass ``gpu.nvidia.com``; each node
publishes one pool named after the node with devices ``gpu-0``, ``gpu-1``, ... carrying the
attributes ``type`` ("gpu"), ``uuid``, ``index`` and ``productName`` and the capacity
``memory`` (bytes).

A node's devices are simulated GPUs (:mod:`tests.fakegpu`, one directory per device with its
physics in ``device.json``), or, in real-GPU mode, the host's GPUs as NVML lists them.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.fakegpu.model import ACTIVATION_FRACTION, Device, default_context, default_reserve

DRIVER = "gpu.nvidia.com"
DEVICE_CLASS = "gpu.nvidia.com"
GPU_RESOURCE = "nvidia.com/gpu"
NODE_LABEL = "localnode.omnistage.io/node"
K8S_VERSION = "v1.36.3"
GiB = 1024**3


FAKE_GPU_PROBE = "tests.fakegpu.probe:from_env"


@dataclass(frozen=True)
class GpuDevice:
    """One GPU as the node publishes it: ``gpu-<index>``, its UUID, product and memory."""

    name: str
    index: int
    uuid: str
    product: str
    memory: int


@dataclass(frozen=True)
class NodeSpec:
    """One GPU node: simulated GPUs (with their physics), or the host's real ones.

    ``gpu_reserve``/``gpu_context``: bytes, None for the defaults scaled to ``gpu_memory``
    (0.6% reserve, 612 MiB context on an H100); ``gpu_activation``: a float is a fraction of a
    process's weights, an int absolute bytes. ``real_gpus``: the host's devices (real-GPU
    mode; ``gpus`` and ``gpu_memory`` are then ignored).
    """

    name: str
    index: int
    gpus: int = 2
    gpu_memory: int = 80 * GiB
    cpu: str = "16"
    memory: str = "64Gi"
    pods: int = 110
    address: str = "127.10.0.1"
    gpu_reserve: int | None = None
    gpu_context: int | None = None
    gpu_activation: float | int = ACTIVATION_FRACTION
    real_gpus: tuple[GpuDevice, ...] | None = None

    @property
    def real(self) -> bool:
        """Whether the node's devices are the host's real GPUs."""
        return self.real_gpus is not None

    def devices(self) -> list[GpuDevice]:
        """The devices the node publishes, in index order."""
        if self.real_gpus is not None:
            return list(self.real_gpus)
        product = f"Fake GPU {self.gpu_memory // GiB}GiB"
        return [
            GpuDevice(f"gpu-{i}", i, self._fake_uuid(f"gpu-{i}"), product, self.gpu_memory)
            for i in range(self.gpus)
        ]

    def device_names(self) -> list[str]:
        """``gpu-0`` .. ``gpu-(G-1)``."""
        return [d.name for d in self.devices()]

    def device(self, name: str) -> GpuDevice:
        """The device called ``name`` (or with that UUID); KeyError when the node lacks it."""
        for dev in self.devices():
            if name in (dev.name, dev.uuid):
                return dev
        raise KeyError(f"node {self.name} has no device {name!r}")

    def _fake_uuid(self, device: str) -> str:
        return "GPU-" + str(uuid.uuid5(uuid.NAMESPACE_DNS, f"{self.name}.{device}.localnode"))

    def device_uuid(self, device: str) -> str:
        """The UUID of ``device`` on this node (stable for simulated GPUs)."""
        return self.device(device).uuid

    def fake_device(self, name: str) -> Device:
        """The physics of simulated device ``name`` (what ``device.json`` holds)."""
        dev = self.device(name)
        return Device(
            uuid=dev.uuid,
            index=dev.index,
            name=dev.product,
            total=dev.memory,
            reserve=default_reserve(dev.memory) if self.gpu_reserve is None else self.gpu_reserve,
            context=default_context(dev.memory) if self.gpu_context is None else self.gpu_context,
            activation=self.gpu_activation,
        )


def fake_gpu_dir(state_dir: Path, node: str, device: str) -> Path:
    """The directory of simulated device ``device`` of ``node`` under localnode's state dir."""
    return state_dir / "fakegpu" / node / device


def real_gpu_devices(records: Iterable[Mapping[str, Any]]) -> tuple[GpuDevice, ...]:
    """The node's devices from NVML-like records ``{index, uuid, name, total}``."""
    out = [
        GpuDevice(
            name=f"gpu-{int(r['index'])}",
            index=int(r["index"]),
            uuid=str(r["uuid"]),
            product=str(r["name"]),
            memory=int(r["total"]),
        )
        for r in records
    ]
    return tuple(sorted(out, key=lambda d: d.index))


def nvml_records() -> list[dict[str, Any]]:
    """The host's GPUs as NVML lists them (index, UUID, product name, total memory)."""
    import pynvml

    def text(value: str | bytes) -> str:
        return value.decode() if isinstance(value, bytes) else value

    pynvml.nvmlInit()
    try:
        records = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            records.append(
                {
                    "index": i,
                    "uuid": text(pynvml.nvmlDeviceGetUUID(handle)),
                    "name": text(pynvml.nvmlDeviceGetName(handle)),
                    "total": int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
                }
            )
        return records
    finally:
        pynvml.nvmlShutdown()


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
        GPU_RESOURCE: str(len(node.devices())),
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
            "name": dev.name,
            "attributes": {
                "type": {"string": "gpu"},
                "uuid": {"string": dev.uuid},
                "index": {"int": dev.index},
                "productName": {"string": dev.product},
            },
            "capacity": {"memory": {"value": quantity(dev.memory)}},
        }
        for dev in node.devices()
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
    """Parse an explicit ``NVIDIA_VISIBLE_DEVICES`` (``gpu-0,gpu-1``, ``0,1``, UUIDs; ``all``).

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
        try:
            out.append(node.device(f"gpu-{part}" if part.isdigit() else part).name)
        except KeyError:
            raise ValueError(
                f"NVIDIA_VISIBLE_DEVICES names {part!r}, which node {node.name} "
                f"does not have ({', '.join(names)})"
            ) from None
    return out


def sort_devices(devices: list[str]) -> list[str]:
    """Unique devices in index order."""

    def key(d: str) -> tuple[int, str]:
        tail = d.rsplit("-", 1)[-1]
        return (int(tail) if tail.isdigit() else 1 << 30, d)

    return sorted(set(devices), key=key)


# Per-pod GPU variables localnode sets (and removes from pods without a device).
GPU_ENV_KEYS = (
    "NVIDIA_VISIBLE_DEVICES",
    "CUDA_VISIBLE_DEVICES",
    "OMNISTAGE_MEMORY_PROBE",
    "OMNISTAGE_FAKE_GPU",
    "OMNISTAGE_MEMORY_CAPACITY",
    "OMNISTAGE_MEMORY_LEDGER",
    "OMNISTAGE_RESIDUAL_SLACK",
)
# The worker's residual slack (128 MiB on an 80 GiB device) scaled to a simulated device, as
# the context charge is: a tiny device's test leak is then above the slack, as a real leak of
# the same share would be on an H100 (the CRD reserves both the flag and the variable).
SLACK_SHARE = (128 << 20) / (80 << 30)


def residual_slack(total: int) -> int:
    """The residual slack localnode gives a worker on a simulated device of ``total`` bytes."""
    return max(1024, round(total * SLACK_SHARE))


def gpu_env(node: NodeSpec, devices: list[str], state_dir: Path) -> dict[str, str]:
    """The GPU environment for a container that got ``devices`` (empty: none).

    Real GPUs: ``CUDA_VISIBLE_DEVICES`` and ``NVIDIA_VISIBLE_DEVICES`` list the devices'
    UUIDs. Simulated GPUs: the same variables list the devices' UUIDs (the ResourceSlice's), and
    ``OMNISTAGE_MEMORY_PROBE``/``OMNISTAGE_FAKE_GPU`` plug the worker into the devices'
    directories, comma-separated in the same order (a ``--gpus N`` worker measures the first N,
    each apart), and ``OMNISTAGE_RESIDUAL_SLACK`` scales the worker's slack to the device.
    """
    if not devices:
        return {}
    devs = [node.device(d) for d in sort_devices(devices)]
    uuids = ",".join(d.uuid for d in devs)
    if node.real:
        return {"NVIDIA_VISIBLE_DEVICES": uuids, "CUDA_VISIBLE_DEVICES": uuids}
    return {
        "NVIDIA_VISIBLE_DEVICES": uuids,
        "CUDA_VISIBLE_DEVICES": uuids,
        "OMNISTAGE_MEMORY_PROBE": FAKE_GPU_PROBE,
        "OMNISTAGE_FAKE_GPU": ",".join(
            str(fake_gpu_dir(state_dir, node.name, d.name)) for d in devs
        ),
        "OMNISTAGE_RESIDUAL_SLACK": str(residual_slack(min(d.memory for d in devs))),
    }


NODES_PER_OCTET = 250


def node_address(octet: int, index: int) -> str:
    """Node ``index``'s host IP: ``127.<octet + index // 250>.<index % 250>.1`` (pods get
    ``.2``-``.254`` of its /24), so hundreds of nodes take consecutive second octets."""
    return f"127.{octet + index // NODES_PER_OCTET}.{index % NODES_PER_OCTET}.1"


def octets_needed(first: int, count: int) -> int:
    """How many second octets nodes ``first``..``first+count-1`` span from the first one."""
    return (first + count - 1) // NODES_PER_OCTET + 1
