"""How ``bench/worker_sleep.py`` measures: device work timed to its end, NVML's figures of this
process and the device, and the host's copy limits with the engine's own exact-size registered
host buffers (a child of its own, also run by ``bench/vllm_stage.py`` and ``bench/gpu_e2e.py``)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from omnistage_worker.engine.host_memory import HostBuffer

GiB = 1024**3
Json = dict[str, Any]


def device() -> torch.device:
    return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], object]) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def nvml_process_bytes() -> int | None:
    """NVML's figure of this process's memory on GPU 0 (None on CPU or if NVML can't say)."""
    if not torch.cuda.is_available():
        return None
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
        if proc.pid == os.getpid() and proc.usedGpuMemory is not None:
            return int(proc.usedGpuMemory)
    return None


def nvml_device_used() -> int | None:
    if not torch.cuda.is_available():
        return None
    import pynvml

    pynvml.nvmlInit()
    info = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0))
    return int(info.used)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def child_limits(size: int) -> Json:
    """Copy limits, measured with the engine's own exact-size registered host buffers."""
    from omnistage_worker.engine.host_memory import HostBuffer  # the caller puts it on the path

    dev = device()
    torch.zeros(1, device=dev)
    sync()
    context = nvml_process_bytes()
    pin = dev.type == "cuda"
    started = time.perf_counter()
    host = HostBuffer(size, pin=pin)
    pin_seconds = time.perf_counter() - started
    host.tensor.fill_(7)
    gpu = torch.empty(size, dtype=torch.uint8, device=dev)
    pageable = torch.empty(size, dtype=torch.uint8)
    pageable.fill_(3)
    h2d, d2h, page = _steady_copies(host.tensor, gpu, pageable)
    del gpu, pageable
    fresh = [_fresh_copy(host, size, gap) for gap in (0.0, 0.0, 0.0, 1.0, 1.0, 1.0)]
    host.release()
    return {
        "h2d_pinned_into_just_freed_gbps": gbps(size, min(fresh[:3])),
        "h2d_pinned_into_freed_1s_ago_gbps": gbps(size, min(fresh[3:])),
        "buffer_bytes": size,
        "cuda_context_bytes": context,
        "pin_seconds_per_gib": pin_seconds / (size / GiB),
        "h2d_pinned_gbps": gbps(size, min(h2d)),
        "d2h_pinned_gbps": gbps(size, min(d2h)),
        "h2d_pageable_gbps": gbps(size, min(page)),
    }


def _steady_copies(
    host: torch.Tensor, gpu: torch.Tensor, pageable: torch.Tensor
) -> tuple[list[float], list[float], list[float]]:
    """Seconds of pinned H2D, pinned D2H and pageable H2D copies into touched device memory."""
    h2d, d2h, page = [], [], []
    for _ in range(5):
        h2d.append(timed(lambda: gpu.copy_(host, non_blocking=True)))
        d2h.append(timed(lambda: host.copy_(gpu, non_blocking=True)))
        page.append(timed(lambda: gpu.copy_(pageable)))
    return h2d, d2h, page


def _fresh_copy(host: HostBuffer, size: int, gap: float) -> float:
    """A bare allocate-and-copy into device memory freed ``gap`` seconds ago: what a wake meets.

    Right after memory goes back to the driver, copies into a new allocation run slower for about
    a second (the driver's own post-free work); the engine's wake pays the same, so its rate is
    compared with this figure taken under the same condition.
    """
    dev = device()
    scratch = torch.empty(size, dtype=torch.uint8, device=dev)
    scratch.fill_(1)
    del scratch
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    time.sleep(gap)

    def alloc_and_copy() -> None:
        torch.empty(size, dtype=torch.uint8, device=dev).copy_(host.tensor, non_blocking=True)

    seconds = timed(alloc_and_copy)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return seconds
