"""localnode with real GPUs, for ``bench/gpu_e2e.py`` until localnode has its own real mode.

``python -m bench.gpu_localnode <localnode flags>`` runs ``tests.cluster.localnode`` unchanged
except for the environment of a container that got devices: localnode's ``gpu-<i>`` becomes
NVML's device i, named by UUID in ``CUDA_VISIBLE_DEVICES`` and ``NVIDIA_VISIBLE_DEVICES``; the
fake-GPU variables (``OMNISTAGE_MEMORY_CAPACITY``, ``OMNISTAGE_MEMORY_LEDGER``) are removed; and
``LD_LIBRARY_PATH`` is passed through (the driver's library may live there). A container
without devices gets ``CUDA_VISIBLE_DEVICES=""``. Start it with ``--gpus`` equal to NVML's
device count and ``--gpu-memory`` equal to one device's total memory.
"""

from __future__ import annotations

import os
import runpy
from typing import Any

import pynvml

from tests.cluster.localnode import runtime

FAKE = ("OMNISTAGE_MEMORY_CAPACITY", "OMNISTAGE_MEMORY_LEDGER")
PASSED = ("LD_LIBRARY_PATH",)


def device_uuids() -> list[str]:
    """NVML's devices' UUIDs by index."""
    pynvml.nvmlInit()
    out = []
    for i in range(pynvml.nvmlDeviceGetCount()):
        uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))
        out.append(uuid.decode() if isinstance(uuid, bytes) else uuid)
    return out


def real_env(env: dict[str, str], uuids: list[str]) -> dict[str, str]:
    """A container's environment with localnode's fake device names replaced by real UUIDs."""
    out = {k: v for k, v in env.items() if k not in FAKE}
    names = [n for n in out.get("NVIDIA_VISIBLE_DEVICES", "").split(",") if n]
    if names:
        real = ",".join(uuids[int(n.removeprefix("gpu-"))] for n in names)
        out["CUDA_VISIBLE_DEVICES"] = out["NVIDIA_VISIBLE_DEVICES"] = real
    else:
        out["CUDA_VISIBLE_DEVICES"] = ""
    for key in PASSED:
        if key in os.environ:
            out[key] = os.environ[key]
    return out


def install() -> None:
    """Wrap the pod runner's environment builder."""
    uuids = device_uuids()
    original = runtime.PodRunner._env

    async def _env(self: Any, spec: Any, mounts: dict[str, str]) -> dict[str, str]:
        return real_env(await original(self, spec, mounts), uuids)

    runtime.PodRunner._env = _env  # type: ignore[method-assign]


if __name__ == "__main__":
    install()
    runpy.run_module("tests.cluster.localnode", run_name="__main__", alter_sys=True)
