"""Measured device memory: one probe per kind of device, and :func:`build_probe` to pick it.

A probe's ``read`` is taken before and after every transition; nothing here trusts a return
code. Modules: :mod:`.base` (readings and the :class:`MemoryProbe` protocol), :mod:`.nvml`
(CUDA: NVML for this process), :mod:`.accounting` (CPU: exact tensor accounting).

:func:`build_probe` picks the probe: ``OMNISTAGE_MEMORY_PROBE=module:factory`` (a test seam: the
test harness's simulated GPU, ``tests.fakegpu.probe:from_env``, is plugged in this way and
``factory(config)`` builds it), else NVML on CUDA, else CPU accounting.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Mapping

from omnistage_worker.config import WorkerConfig
from omnistage_worker.memory.accounting import AccountingProbe
from omnistage_worker.memory.base import DeviceReading, EngineTreeProbe, MemoryProbe, Reading
from omnistage_worker.memory.nvml import (
    PROBE_BYTES,
    NvmlProbe,
    create_cuda_context,
    cuda_allocator,
    new_pids,
    nvml_target,
    pick_grown_pid,
    process_tree,
    visible_device_ids,
)

__all__ = [
    "PROBE_BYTES",
    "PROBE_ENV",
    "AccountingProbe",
    "DeviceReading",
    "EngineTreeProbe",
    "MemoryProbe",
    "NvmlProbe",
    "Reading",
    "build_probe",
    "create_cuda_context",
    "cuda_allocator",
    "new_pids",
    "nvml_target",
    "pick_grown_pid",
    "process_tree",
    "visible_device_ids",
]

log = logging.getLogger(__name__)

PROBE_ENV = "OMNISTAGE_MEMORY_PROBE"


def build_probe(config: WorkerConfig, env: Mapping[str, str] | None = None) -> MemoryProbe:
    """The probe for ``config``: ``$OMNISTAGE_MEMORY_PROBE``'s factory, NVML on CUDA, else CPU.

    ``OMNISTAGE_MEMORY_PROBE=package.module:factory`` imports the module and returns
    ``factory(config)``: a documented seam for simulated devices in tests (it wins over the
    device flag, and the factory refuses a configuration it cannot simulate).
    """
    environ = os.environ if env is None else env
    seam = environ.get(PROBE_ENV, "").strip()
    if seam:
        module_name, sep, attr = seam.partition(":")
        if not sep or not module_name or not attr:
            raise ValueError(f"{PROBE_ENV}={seam!r}: expected 'package.module:factory'")
        factory = getattr(importlib.import_module(module_name), attr)
        probe: MemoryProbe = factory(config)
        log.info("memory probe from %s=%s: %s", PROBE_ENV, seam, type(probe).__name__)
        return probe
    if config.device.is_cuda:
        vllm = config.backend == "vllm"
        return NvmlProbe(config.device.index, include_children=vllm, own_context=not vllm)
    return AccountingProbe(lambda: 0)
