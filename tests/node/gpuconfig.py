"""Pure logic for the real node's simulated GPUs: the CDI specification and the DRA plugin's
configuration.

On a real cluster a GPU reaches a container through its DRA driver and CDI: the driver's
kubelet plugin publishes the node's devices in a ResourceSlice, prepares an allocated claim
by naming CDI devices, and the container runtime (``enable_cdi``) applies those devices'
edits to the container: device nodes, the driver's user-space libraries mounted in, and the
environment. The real node does the same with simulated GPUs (:mod:`tests.fakegpu`), so a
worker pod needs no hostPath and runs under the ``restricted`` Pod Security Standard:

* the plugin (``tests/node/fakegpudra``, driver ``gpu.nvidia.com`` as localnode and the NVIDIA
  driver name it) publishes ``gpu-0`` ... with localnode's attributes and prepares a claim as
  the CDI devices ``omnistage.io/fakegpu=<device>``;
* the CDI spec written here gives each device its directory (mounted read-write at
  :data:`CONTAINER_GPU_ROOT`/<device>) and the environment localnode gives a pod on a
  simulated GPU (:func:`tests.cluster.localnode.devices.gpu_env`, with container paths), and
  every device the simulated driver's user-space part: ``tests/fakegpu`` (staged under the
  node's state directory) mounted read-only at :data:`CONTAINER_LIB` and put on
  ``PYTHONPATH``, as the NVIDIA toolkit mounts ``libnvidia-ml`` into a GPU container.

A container gets one device's environment; a claim of several devices per container is not
supported here (the last device's variables would win).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.cluster.localnode.devices import (
    DRIVER,
    FAKE_GPU_PROBE,
    GpuDevice,
    NodeSpec,
    residual_slack,
)

CDI_VENDOR = "omnistage.io"
CDI_CLASS = "fakegpu"
CDI_KIND = f"{CDI_VENDOR}/{CDI_CLASS}"
CDI_VERSION = "0.6.0"
CONTAINER_GPU_ROOT = "/run/omnistage-fakegpu"
CONTAINER_LIB = "/opt/omnistage-fakegpu"
# what the simulated driver's user-space part needs from this repository (beside the worker)
LIB_FILES = ("tests/__init__.py", "tests/fakegpu")


@dataclass(frozen=True)
class NodeGpus:
    """The real node's simulated GPUs: how many and each one's memory (bytes)."""

    count: int = 1
    memory: int = 2 * 1024**3

    def spec(self, node: str) -> NodeSpec:
        """localnode's description of such a node (device names, UUIDs, physics)."""
        return NodeSpec(name=node, index=0, gpus=self.count, gpu_memory=self.memory)


def container_gpu_dir(device: str) -> str:
    """Where a container sees simulated device ``device``'s directory."""
    return f"{CONTAINER_GPU_ROOT}/{device}"


def cdi_device_id(device: str) -> str:
    """The fully qualified CDI name the plugin returns for ``device``."""
    return f"{CDI_KIND}={device}"


def _device_edits(device: GpuDevice, host_dir: Path) -> dict[str, Any]:
    env = {
        "NVIDIA_VISIBLE_DEVICES": device.uuid,
        "CUDA_VISIBLE_DEVICES": device.uuid,
        "OMNISTAGE_MEMORY_PROBE": FAKE_GPU_PROBE,
        "OMNISTAGE_FAKE_GPU": container_gpu_dir(device.name),
        "OMNISTAGE_RESIDUAL_SLACK": str(residual_slack(device.memory)),
    }
    return {
        "env": [f"{k}={v}" for k, v in env.items()],
        "mounts": [
            {
                "hostPath": str(host_dir),
                "containerPath": container_gpu_dir(device.name),
                "type": "bind",
                "options": ["rbind", "rw", "nosuid", "nodev", "noexec"],
            }
        ],
    }


def cdi_spec(devices: list[GpuDevice], gpu_dirs: dict[str, Path], lib_dir: Path) -> dict[str, Any]:
    """The CDI spec of the node's simulated GPUs (``gpu_dirs``: device name -> its directory;
    ``lib_dir``: the staged user-space part, holding ``tests/fakegpu``)."""
    return {
        "cdiVersion": CDI_VERSION,
        "kind": CDI_KIND,
        "devices": [
            {"name": d.name, "containerEdits": _device_edits(d, gpu_dirs[d.name])} for d in devices
        ],
        "containerEdits": {
            "env": [f"PYTHONPATH={CONTAINER_LIB}"],
            "mounts": [
                {
                    "hostPath": str(lib_dir),
                    "containerPath": CONTAINER_LIB,
                    "type": "bind",
                    "options": ["rbind", "ro", "nosuid", "nodev"],
                }
            ],
        },
    }


def plugin_config(node: str, devices: list[GpuDevice]) -> dict[str, Any]:
    """The DRA plugin's configuration: the driver, the node (its pool) and the devices."""
    return {
        "driver": DRIVER,
        "node": node,
        "cdiKind": CDI_KIND,
        "devices": [
            {
                "name": d.name,
                "uuid": d.uuid,
                "index": d.index,
                "productName": d.product,
                "memory": d.memory,
            }
            for d in devices
        ],
    }
