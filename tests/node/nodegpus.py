"""Simulated GPUs on a real node, the way a real cluster's GPUs reach containers.

:func:`make_gpus` creates the devices' directories and the staged user-space part, starts the
host side answering for their processes' host pids (:class:`tests.fakegpu.driver.DriverServer`)
and writes the CDI spec naming them (:mod:`tests.node.gpuconfig` holds the pure parts);
:func:`start_dra_plugin` runs the DRA kubelet plugin and waits for the node's ResourceSlice.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.cluster.controlplane import ControlPlane
from tests.cluster.localnode.devices import DRIVER, GpuDevice, device_class
from tests.cluster.procs import ManagedProcess, wait_for
from tests.fakegpu.device import FakeGpu
from tests.fakegpu.driver import DriverServer
from tests.node.gpuconfig import LIB_FILES, NodeGpus, cdi_spec, plugin_config
from tests.node.nodeconfig import NodeLayout, dumps

REPO_ROOT = Path(__file__).resolve().parents[2]


def make_gpus(layout: NodeLayout, gpus: NodeGpus) -> tuple[list[GpuDevice], DriverServer]:
    """The devices' directories (writable by the containers' users), the staged user-space
    part, the host side serving them (started: the caller exits it), and the CDI spec."""
    spec = gpus.spec(layout.name)
    devices = spec.devices()
    dirs: dict[str, Path] = {}
    for device in devices:
        gpu = FakeGpu.create(layout.gpu_dir / device.name, spec.fake_device(device.name))
        (gpu.dir / "lock").touch()
        for path in (gpu.dir, gpu.procs_dir, gpu.dir / "lock"):
            os.chmod(path, 0o666 if path.is_file() else 0o777)
        dirs[device.name] = gpu.dir
    lib = layout.gpu_dir / "lib"
    for relative in LIB_FILES:
        source, target = REPO_ROOT / relative, lib / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, target)
    for path in [lib, *lib.rglob("*")]:
        os.chmod(path, 0o755 if path.is_dir() else 0o644)
    driver = DriverServer(dirs.values()).__enter__()
    layout.cdi_dir.mkdir(parents=True)
    spec_file = layout.cdi_dir / "omnistage-fakegpu.json"
    spec_file.write_text(dumps(cdi_spec(devices, dirs, lib)))
    return devices, driver


def start_dra_plugin(
    cp: ControlPlane,
    layout: NodeLayout,
    devices: list[GpuDevice],
    binary: Path,
    spawn: Callable[[str, list[str]], ManagedProcess],
) -> float:
    """The DRA kubelet plugin (the node's credentials), started with ``spawn``; ready once its
    ResourceSlice is published (the kubelet retries a pod whose driver has not registered yet).
    Returns the seconds it took."""
    cp.apply(device_class())
    config = layout.state / "fakegpu-dra.json"
    config.write_text(dumps(plugin_config(layout.name, devices)))
    registry = layout.kubelet_dir / "plugins_registry"
    registry.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    plugin = spawn(
        "fakegpu-dra",
        [
            str(binary),
            f"--config={config}",
            f"--kubeconfig={layout.kubeconfig}",
            f"--registry-dir={registry}",
            f"--plugin-dir={layout.kubelet_dir / 'plugins' / DRIVER}",
            "--v=2",
        ],
    )

    def published() -> bool:
        selector = f"spec.nodeName={layout.name}"
        slices = cp.get_json("resourceslices", "--field-selector", selector)["items"]
        return any(s["spec"]["driver"] == DRIVER for s in slices)

    wait_for("the DRA plugin's ResourceSlice", published, 60, interval=0.5, alive=plugin.died)
    return time.monotonic() - t0


def gpu_node_args(gpus: NodeGpus) -> dict[str, Any]:
    """RealNode's arguments for simulated GPUs through DRA and CDI: the tools built by
    ``python -m tests.node.gotools`` (BuildError when they are not)."""
    from tests.node.gotools import find_tool

    return {
        "containerd": find_tool("containerd"),
        "gpus": gpus,
        "dra_plugin": find_tool("fakegpu-dra") / "fakegpu-dra",
    }
