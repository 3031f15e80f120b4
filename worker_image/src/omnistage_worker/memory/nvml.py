"""CUDA devices: NVML figures for this process (and, for vLLM, its children).

NVML renumbers nothing: ``CUDA_VISIBLE_DEVICES`` is mapped to NVML indices or UUIDs here, and
in a container with its own PID namespace the process is recognised by the growth of a probe
allocation (:meth:`NvmlProbe.resolve_pid`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import psutil

from omnistage.worker.v1 import types_pb2
from omnistage_worker.memory import uncharged
from omnistage_worker.memory.base import DeviceReading, Reading

log = logging.getLogger(__name__)


def visible_device_ids(env: str | None) -> list[str] | None:
    """Parse ``CUDA_VISIBLE_DEVICES`` into its entries (None when unset: all devices)."""
    if env is None:
        return None
    return [part.strip() for part in env.split(",") if part.strip()]


def nvml_target(torch_index: int, env: str | None) -> tuple[str, str]:
    """How to find torch device ``torch_index`` in NVML: ``("index", "N")`` or ``("uuid", id)``.

    ``CUDA_VISIBLE_DEVICES`` renumbers devices for CUDA but not for NVML; its entries are NVML
    indices or UUID prefixes (``GPU-...``/``MIG-...``).
    """
    ids = visible_device_ids(env)
    if ids is None:
        return "index", str(torch_index)
    if torch_index >= len(ids):
        raise ValueError(
            f"cuda:{torch_index} is not visible (CUDA_VISIBLE_DEVICES={env!r} lists {len(ids)})"
        )
    entry = ids[torch_index]
    if entry.isdigit():
        return "index", entry
    return "uuid", entry


PROBE_BYTES = 256 * 1024 * 1024
_DEV_NVIDIA = re.compile(r"/dev/nvidia\d+")


def pick_grown_pid(before: dict[int, int], after: dict[int, int], nbytes: int) -> int | None:
    """The one pid whose NVML usage grew by about ``nbytes`` (None when not exactly one)."""
    grown = [pid for pid, used in after.items() if used - before.get(pid, 0) >= nbytes * 9 // 10]
    return grown[0] if len(grown) == 1 else None


def process_tree(pid: int) -> set[int]:
    """``pid`` and all its descendants (vLLM runs its engine core in a child process)."""
    pids = {pid}
    with contextlib.suppress(psutil.Error):
        pids.update(child.pid for child in psutil.Process(pid).children(recursive=True))
    return pids


def new_pids(before: Iterable[int], after: Iterable[int]) -> set[int]:
    """NVML pids listed ``after`` that were not listed ``before`` (an engine that started)."""
    return set(after) - set(before)


class NvmlProbe:
    """NVML figures for this process on one CUDA device.

    ``include_children`` also counts the process's descendants: vLLM runs its engine core in a
    child process, which holds the weights. The torch runners count their own pid only, so a
    process that happens to start another worker never reports that worker's memory.

    ``own_context=False`` (vLLM): this process never creates a CUDA context (no torch CUDA
    call: ``touch`` and ``release_cached`` do nothing) and measures its engine's process tree.
    Where the driver reports host pids (a container's own PID namespace), the engine is
    recognised as the NVML pids that appeared while it started (:meth:`adopt_engine`).
    """

    source = types_pb2.MEMORY_SOURCE_NVML

    def __init__(
        self,
        torch_index: int,
        pid: int | None = None,
        include_children: bool = False,
        own_context: bool = True,
    ) -> None:
        import pynvml

        self._nvml: Any = pynvml
        pynvml.nvmlInit()
        self.pid = os.getpid() if pid is None else pid
        self.torch_index = torch_index
        self.include_children = include_children
        self.own_context = own_context
        self.engine_pids: set[int] = set()  # host pids of the engine, when adopted
        # Why this probe's per-process figures cannot be trusted ("" when they can): NVML
        # lists no pid it could recognise as this process (or its engine), so they read 0 and
        # a sleep ACK built on them would claim memory freed without proof.
        self.unverified = ""
        self._handle = self._find_handle(torch_index)
        self.index = int(pynvml.nvmlDeviceGetIndex(self._handle))
        self.uuid = _text(pynvml.nvmlDeviceGetUUID(self._handle))
        self.minor: int | None = None  # /dev/nvidia<minor>: how this tree's processes see it
        with contextlib.suppress(Exception):
            self.minor = int(pynvml.nvmlDeviceGetMinorNumber(self._handle))
        self._warned = False
        log.info("NVML: cuda:%d is NVML device %d (%s)", torch_index, self.index, self.uuid)

    def _find_handle(self, torch_index: int) -> Any:
        nvml = self._nvml
        uuid = _torch_uuid(torch_index) if self.own_context else None
        if uuid is not None:
            return nvml.nvmlDeviceGetHandleByUUID(uuid)
        how, ident = nvml_target(torch_index, os.environ.get("CUDA_VISIBLE_DEVICES"))
        if how == "index":
            return nvml.nvmlDeviceGetHandleByIndex(int(ident))
        for i in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            if _text(nvml.nvmlDeviceGetUUID(handle)).startswith(ident):
                return handle
        raise ValueError(f"no NVML device has a UUID starting with {ident!r}")

    def touch(self) -> None:
        """Create the CUDA context, then make sure NVML lists this process under a known pid."""
        if not self.own_context:
            return
        create_cuda_context(self.torch_index)
        self.resolve_pid(cuda_allocator(self.torch_index))

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """NVML sees what a request takes by itself."""
        yield

    def release_cached(self) -> None:
        """Return the caching allocator's free blocks to the driver (NVML then sees them free)."""
        if not self.own_context:
            return  # the engine's own process frees its memory; no context here
        import torch

        torch.cuda.synchronize(self.torch_index)
        torch.cuda.empty_cache()

    def processes(self) -> dict[int, int]:
        """NVML's compute processes on the device: pid -> used bytes."""
        procs: Iterable[Any] = self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle)
        return {int(p.pid): int(p.usedGpuMemory or 0) for p in procs}

    def resolve_pid(self, allocate: Callable[[int], Callable[[], None]]) -> None:
        """Find the pid NVML knows this process by (call once the CUDA context exists).

        In a container with its own PID namespace NVML reports host pids, so ``os.getpid()``
        is not in its list. Then this process is recognised by growth: ``allocate(n)`` takes n
        device bytes (and returns the function that frees them); the one NVML pid that grew by
        n, in two rounds that agree, is this process.
        """
        if self.pid in self.processes():
            return
        found: list[int | None] = []
        for _ in range(2):
            before = self.processes()
            release = allocate(PROBE_BYTES)
            try:
                after = self.processes()
            finally:
                release()
            found.append(pick_grown_pid(before, after, PROBE_BYTES))
        if found[0] is not None and found[0] == found[1]:
            log.info(
                "NVML knows this process (pid %d here) as pid %d: container PID namespace",
                self.pid,
                found[0],
            )
            self.pid = found[0]
            self.include_children = False  # descendants' host pids are unknown
            return
        self.unverified = (
            f"NVML does not list this process (pid {self.pid}) and it could not be recognised "
            f"by growth (candidates {found}): its own figures read 0"
        )
        log.error("%s; every sleep Ack will be not ok", self.unverified)

    def listed_pids(self) -> set[int]:
        """The pids NVML lists on the device now (take it before the engine starts)."""
        return set(self.processes())

    def own_device_users(self) -> set[int]:
        """Processes of this worker's own tree (itself excluded) that hold this device open
        (``/dev/nvidia<minor>`` among their file descriptors): the engine's, by this
        namespace's pids."""
        minor = getattr(self, "minor", None)
        names = {f"/dev/nvidia{minor}"} if minor is not None else None
        users = set()
        for pid in process_tree(self.pid) - {self.pid}:
            with contextlib.suppress(OSError):
                for fd in os.listdir(f"/proc/{pid}/fd"):
                    with contextlib.suppress(OSError):
                        target = os.readlink(f"/proc/{pid}/fd/{fd}")
                        if (names is None and _DEV_NVIDIA.fullmatch(target)) or (
                            names is not None and target in names
                        ):
                            users.add(pid)
                            break
        return users

    def adopt_engine(self, before: set[int]) -> None:
        """After the engine started: when NVML lists no pid of this process tree (host pids),
        the pids that appeared on the device since ``before`` are the engine's only when they
        are as many as the processes of this worker's own tree that hold the device open. More
        (another tenant started meanwhile) or none: nothing is adopted, since a foreign
        process's memory must never count as the engine's, and the figures are marked
        unverified (every sleep Ack not ok)."""
        listed = self.processes()
        if process_tree(self.pid) & listed.keys():
            return
        appeared = new_pids(before, listed)
        own = self.own_device_users()
        if appeared and len(appeared) == len(own):
            log.info(
                "NVML lists no pid of this process tree (a container PID namespace); the "
                "engine is the pids that appeared while it started: %s (its own tree holds "
                "the device in %d processes)",
                sorted(appeared),
                len(own),
            )
            self.engine_pids = appeared
            return
        if appeared:
            self.unverified = (
                f"NVML lists no process of this engine's tree; {len(appeared)} pids appeared "
                f"on the device while it started ({sorted(appeared)}) but {len(own)} processes "
                "of its own tree hold the device: which are the engine's cannot be told"
            )
        else:
            self.unverified = "NVML lists no process of the engine: its figures read 0"
        log.error("%s; every sleep Ack will be not ok", self.unverified)

    def _process_used(self) -> int:
        pids = process_tree(self.pid) if self.include_children else {self.pid}
        pids |= self.engine_pids
        listed = self.processes()
        if not pids & listed.keys() and not self._warned:
            self._warned = True
            log.warning("NVML lists no process of pid %d on device %d", self.pid, self.index)
        return sum(used for pid, used in listed.items() if pid in pids)

    def read(self) -> Reading:
        info = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
        device = DeviceReading(
            device=f"cuda:{self.torch_index}",
            index=self.index,
            uuid=self.uuid,
            used=self._process_used() + uncharged.kept_bytes(self.torch_index),
            free=int(info.free),
            total=int(info.total),
        )
        return Reading((device,), self.source)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._nvml.nvmlShutdown()


def cuda_allocator(index: int) -> Callable[[int], Callable[[], None]]:
    """``allocate(n)``: take n bytes on the device (outside the caching allocator's pool)."""
    import torch

    def allocate(nbytes: int) -> Callable[[], None]:
        block = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{index}")
        block.fill_(1)
        torch.cuda.synchronize(index)

        def release() -> None:
            nonlocal block
            del block
            torch.cuda.synchronize(index)
            torch.cuda.empty_cache()

        return release

    return allocate


def create_cuda_context(index: int) -> None:
    """Create the CUDA context before any weight loads, so NVML can measure it alone."""
    import torch

    torch.cuda.set_device(index)
    probe = torch.zeros(1, device=f"cuda:{index}")
    del probe
    torch.cuda.synchronize(index)
    torch.cuda.empty_cache()


def _torch_uuid(torch_index: int) -> str | None:
    """The NVML-style UUID of torch's device (``GPU-...``), when torch exposes it."""
    try:
        import torch

        uuid = getattr(torch.cuda.get_device_properties(torch_index), "uuid", None)
    except Exception:
        return None
    if uuid is None:
        return None
    text = str(uuid)
    return text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
