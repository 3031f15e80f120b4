"""Measured device memory: NVML for this process on CUDA, exact tensor accounting on CPU.

A probe's :meth:`MemoryProbe.read` is taken before and after every transition; nothing here
trusts a return code. On CPU the "device" is a fake one: its capacity comes from
``--memory-capacity`` and, with ``--memory-ledger``, every worker on the same fake device
publishes its own used bytes to ``<ledger>/<pid>`` so free = capacity - sum over live workers.

:func:`build_probe` picks the probe: ``OMNISTAGE_MEMORY_PROBE=module:factory`` (a test seam: the
test harness's simulated GPU, ``tests.fakegpu.probe:from_env``, is plugged in this way and
``factory(config)`` builds it), else NVML on CUDA, else CPU accounting.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import psutil

from omnistage.worker.v1 import types_pb2
from omnistage_worker.config import WorkerConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeviceReading:
    """Memory of one device at one instant; ``used`` is this worker's own share."""

    device: str
    index: int
    uuid: str
    used: int
    free: int
    total: int


@dataclass(frozen=True)
class Reading:
    """Memory of all the worker's devices at one instant."""

    devices: tuple[DeviceReading, ...]
    source: types_pb2.MemorySource.ValueType

    @property
    def used(self) -> int:
        return sum(d.used for d in self.devices)

    @property
    def free(self) -> int:
        return sum(d.free for d in self.devices)

    @property
    def total(self) -> int:
        return sum(d.total for d in self.devices)


class MemoryProbe(Protocol):
    """Something that measures the worker's device memory.

    The worker calls :meth:`touch` once before any weight loads (so the context is measured
    alone: the residual baseline), brackets every Generate with :meth:`serving`, and calls
    :meth:`release_cached` right after a sleep, before the measurement that goes into its Ack.
    """

    source: types_pb2.MemorySource.ValueType

    def touch(self) -> None:
        """Create this process's device context (CUDA: what a first tensor does)."""
        ...

    def serving(self) -> contextlib.AbstractContextManager[None]:
        """Bracket one Generate (a real GPU needs nothing; a simulated one charges activations)."""
        ...

    def release_cached(self) -> None:
        """Give cached device blocks back to the driver (after a sleep)."""
        ...

    def read(self) -> Reading: ...

    def close(self) -> None: ...


PROBE_ENV = "OMNISTAGE_MEMORY_PROBE"


def build_probe(config: WorkerConfig, env: dict[str, str] | None = None) -> MemoryProbe:
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
        return NvmlProbe(config.device.index, include_children=config.backend == "vllm")
    ledger = Ledger(config.memory_ledger) if config.memory_ledger is not None else None
    return AccountingProbe(lambda: 0, config.memory_capacity, ledger)


# ---------------------------------------------------------------------------------------------
# CPU: tensor accounting and the shared ledger


class Ledger:
    """A directory shared by the workers of one fake device; one file per worker process.

    Each file holds ``{"used": bytes, "create_time": t}``; ``create_time`` guards against a
    dead worker's pid being reused by an unrelated process.
    """

    def __init__(self, directory: Path, pid: int | None = None) -> None:
        self.directory = directory
        self.pid = os.getpid() if pid is None else pid
        self.directory.mkdir(parents=True, exist_ok=True)
        self._create_time = psutil.Process(self.pid).create_time()
        self._path = directory / str(self.pid)

    def publish(self, used: int) -> None:
        """Write this worker's used bytes (atomically: write then rename)."""
        tmp = self.directory / f".{self.pid}.tmp"
        tmp.write_text(json.dumps({"used": used, "create_time": self._create_time}))
        os.replace(tmp, self._path)

    def others_used(self) -> int:
        """Sum of the used bytes published by the other live workers."""
        total = 0
        for entry in self.directory.iterdir():
            if not entry.name.isdigit() or int(entry.name) == self.pid:
                continue
            record = _read_record(entry)
            if record is None:
                continue
            used, create_time = record
            if _alive(int(entry.name), create_time):
                total += used
        return total

    def remove(self) -> None:
        """Withdraw this worker's entry (at exit)."""
        with contextlib.suppress(FileNotFoundError):
            self._path.unlink()


def _read_record(path: Path) -> tuple[int, float] | None:
    try:
        data: Any = json.loads(path.read_text())
        return int(data["used"]), float(data["create_time"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _alive(pid: int, create_time: float) -> bool:
    try:
        proc = psutil.Process(pid)
        return abs(proc.create_time() - create_time) < 1.0 and proc.status() != "zombie"
    except psutil.Error:
        return False


class AccountingProbe:
    """CPU figures from exact tensor accounting (``used_fn`` sums the weight tensors)."""

    source = types_pb2.MEMORY_SOURCE_ACCOUNTING

    def __init__(
        self,
        used_fn: Callable[[], int],
        capacity: int | None = None,
        ledger: Ledger | None = None,
    ) -> None:
        self._used_fn = used_fn
        self.capacity = capacity if capacity is not None else psutil.virtual_memory().total
        self.ledger = ledger

    def set_used_fn(self, used_fn: Callable[[], int]) -> None:
        """Point the probe at the accounting of a newly built engine."""
        self._used_fn = used_fn

    def touch(self) -> None:
        """Host memory needs no context."""

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """Tensor accounting counts the weights only."""
        yield

    def release_cached(self) -> None:
        """Nothing is cached outside the accounted tensors."""

    def read(self) -> Reading:
        used = self._used_fn()
        others = 0
        if self.ledger is not None:
            self.ledger.publish(used)
            others = self.ledger.others_used()
        free = self.capacity - used - others
        device = DeviceReading("cpu", 0, "", used, free, self.capacity)
        return Reading((device,), self.source)

    def close(self) -> None:
        if self.ledger is not None:
            self.ledger.remove()


# ---------------------------------------------------------------------------------------------
# CUDA: NVML, process-scoped


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


class NvmlProbe:
    """NVML figures for this process on one CUDA device.

    ``include_children`` also counts the process's descendants: vLLM runs its engine core in a
    child process, which holds the weights. The torch runners count their own pid only, so a
    process that happens to start another worker never reports that worker's memory.
    """

    source = types_pb2.MEMORY_SOURCE_NVML

    def __init__(
        self, torch_index: int, pid: int | None = None, include_children: bool = False
    ) -> None:
        import pynvml

        self._nvml: Any = pynvml
        pynvml.nvmlInit()
        self.pid = os.getpid() if pid is None else pid
        self.torch_index = torch_index
        self.include_children = include_children
        self._handle = self._find_handle(torch_index)
        self.index = int(pynvml.nvmlDeviceGetIndex(self._handle))
        self.uuid = _text(pynvml.nvmlDeviceGetUUID(self._handle))
        self._warned = False
        log.info("NVML: cuda:%d is NVML device %d (%s)", torch_index, self.index, self.uuid)

    def _find_handle(self, torch_index: int) -> Any:
        nvml = self._nvml
        uuid = _torch_uuid(torch_index)
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
        create_cuda_context(self.torch_index)
        self.resolve_pid(cuda_allocator(self.torch_index))

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """NVML sees what a request takes by itself."""
        yield

    def release_cached(self) -> None:
        """Return the caching allocator's free blocks to the driver (NVML then sees them free)."""
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
        log.error(
            "NVML does not list this process (pid %d) and it could not be recognised by "
            "growth (candidates %s): its figures will read 0, and sleep Acks cannot be trusted",
            self.pid,
            found,
        )

    def _process_used(self) -> int:
        pids = process_tree(self.pid) if self.include_children else {self.pid}
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
            used=self._process_used(),
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
