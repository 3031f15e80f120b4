"""What a cold start begins before the heavy imports, and the startup's timeline in the log.

The CLI calls :func:`begin` right after parsing its flags, before torch and transformers are
imported (seconds of single-threaded Python). Two threads then work meanwhile:

- the CUDA primary context of each of the stage's devices, created through the driver library
  (ctypes releases the GIL for the call); the CUDA runtime, torch's, uses the same primary
  context, so torch later finds it made;
- the weight files the runner will read, advised ``WILLNEED``: with a cold page cache the
  kernel starts reading them from the disk while Python imports; with a warm one there is
  nothing to read.

:func:`mark` logs a named point of the startup (seconds since the process started, and the
Unix time), the phases ``bench/coldstart.py`` reads back from the log. Nothing here imports
torch; on a CPU stage only the prefetch runs.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from omnistage_worker.config import WorkerConfig
from omnistage_worker.runners import vllm_forkserver

log = logging.getLogger("omnistage_worker.startup")


def since_start() -> float:
    """Seconds since this process started (the kernel's start time, 10 ms resolution)."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0
    return time.clock_gettime(time.CLOCK_BOOTTIME) - started


def mark(phase: str) -> None:
    """Log that the startup reached ``phase``."""
    log.info("startup: %s at +%.3fs (unix %.6f)", phase, since_start(), time.time())


def cuda_ordinals(config: WorkerConfig) -> list[int]:
    """The driver ordinals of the stage's devices (empty: not a CUDA stage)."""
    if not config.device.is_cuda or config.backend == "vllm":  # vLLM: its engine's processes
        return []
    return list(range(config.device.index, config.device.index + config.gpus))


def retain_primary_contexts(ordinals: Sequence[int]) -> float:
    """Create (retain) the primary context of each device; the seconds it took."""
    started = time.perf_counter()
    lib = ctypes.CDLL("libcuda.so.1")
    err = lib.cuInit(0)
    if err != 0:
        raise RuntimeError(f"cuInit failed: CUDA error {err}")
    for ordinal in ordinals:
        device = ctypes.c_int()
        context = ctypes.c_void_p()
        err = lib.cuDeviceGet(ctypes.byref(device), ordinal)
        if err == 0:
            err = lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device)
        if err != 0:
            raise RuntimeError(f"device {ordinal}: CUDA error {err}")
    return time.perf_counter() - started


def prefetch(paths: Sequence[Path]) -> int:
    """Ask the kernel to read ``paths`` into the page cache; the bytes advised."""
    advised = 0
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            advised += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return advised


def _contexts(ordinals: list[int]) -> None:
    try:
        seconds = retain_primary_contexts(ordinals)
    except (OSError, RuntimeError) as exc:  # torch makes the context itself, later
        log.info("CUDA context not made ahead: %s", exc)
        return
    log.info("CUDA context of devices %s made in %.3fs", ordinals, seconds)
    mark("cuda context")


def _prefetch(config: WorkerConfig) -> None:
    from omnistage_worker.runners.weight_files import WeightFileError, weight_files_in

    try:
        paths = weight_files_in(config.model, config.variant)
        advised = prefetch(paths)
    except (OSError, WeightFileError) as exc:  # the loader reports what is wrong with them
        log.info("weight files not prefetched: %s", exc)
        return
    if advised:
        log.info("weight files advised to the page cache: %d bytes", advised)
        mark("prefetch advised")


def begin(config: WorkerConfig) -> list[threading.Thread]:
    """Start the CUDA contexts and the weight-file prefetch on their own threads."""
    mark("flags parsed")
    threads = []
    ordinals = cuda_ordinals(config)
    if ordinals:
        threads.append(threading.Thread(target=_contexts, args=(ordinals,), name="omnistage-ctx"))
    if config.backend == "transformers":  # the runner that reads its files itself
        threads.append(threading.Thread(target=_prefetch, args=(config,), name="omnistage-fetch"))
    if config.backend == "vllm" and vllm_forkserver.enabled():
        vllm_forkserver.begin()  # a process of its own: its imports run beside this one's
    for thread in threads:
        thread.daemon = True
        thread.start()
    return threads
