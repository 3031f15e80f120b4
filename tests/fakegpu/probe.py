"""The worker's view of a simulated GPU: a :class:`MemoryProbe` plugged in through the seam.

``OMNISTAGE_MEMORY_PROBE=tests.fakegpu.probe:from_env`` and ``OMNISTAGE_FAKE_GPU=<device dir>``
make a ``--device cpu`` worker measure a simulated GPU: its weights are the engine's device
bytes (tensor accounting, as on CPU), and the device adds what a real GPU adds (driver reserve,
context, activations while serving, faults). The figures' source stays ``accounting``: they
are computed, not read from NVML, and the worker refuses a wake that would not fit ahead of
time (``not enough free device memory``); a wake whose room is taken after that check (fault
``tenant_on_copy``) runs out during the copy: the weights' growth is charged when the worker
measures right after the copy, and raises a CUDA-worded OOM there, charging nothing.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil

from omnistage.worker.v1 import types_pb2
from omnistage_worker.config import WorkerConfig
from omnistage_worker.memory import (
    AccountingProbe,
    DeviceProbes,
    DeviceReading,
    Reading,
    process_tree,
)
from tests.fakegpu import model
from tests.fakegpu.device import FakeGpu

ENV = "OMNISTAGE_FAKE_GPU"


class FakeGpuProbe(AccountingProbe):
    """This process on a simulated GPU (an AccountingProbe, so the worker feeds it its engine)."""

    source = types_pb2.MEMORY_SOURCE_ACCOUNTING

    def __init__(
        self,
        gpu: FakeGpu,
        used_fn: Callable[[], int] = lambda: 0,
        pid: int | None = None,
        ordinal: int | None = None,
    ) -> None:
        self.gpu = gpu
        self.device = gpu.device()
        # The device as the worker's torch numbers it (cuda:<ordinal>); NVML's index apart.
        self.ordinal = self.device.index if ordinal is None else ordinal
        super().__init__(used_fn, capacity=self.device.total)
        driver = gpu.driver()
        if pid is None and driver is not None:
            # in a container: the device lists host pids (its host side says which is ours)
            self.pid, created = driver.host_identity()
        else:
            self.pid = os.getpid() if pid is None else pid
            created = psutil.Process(self.pid).create_time()
        self._me = model.Proc(self.pid, created)
        self._lock = threading.Lock()

    @property
    def record(self) -> model.Proc:
        """What the device charges this process now."""
        return self._me

    def _others(self) -> list[model.Proc]:
        return [p for pid, p in self.gpu.live().items() if pid != self.pid]

    def _commit(self, me: model.Proc) -> None:
        if me != self._me:
            self.gpu.publish(me)
        self._me = me

    def _sync_weights(self, *, locked: bool = False) -> None:
        """Charge the engine's current device bytes (reading them at this instant). Growth is
        an allocation: it raises the simulated OOM when it does not fit, charging nothing
        (``locked``: the caller holds the device lock already)."""
        weights = self._used_fn()
        if weights == self._me.weights:
            return
        if weights < self._me.weights:
            self._commit(model.with_weights(self._me, weights))
            return
        with contextlib.ExitStack() as stack:
            if not locked:
                stack.enter_context(self.gpu.locked())
            self._tenant_arrives()
            me = model.copy_weights(self.device, self._me, self._others(), weights)
            self._commit(me)

    def _tenant_arrives(self) -> None:
        """Fault ``tenant_on_copy``: another process takes its bytes right before this copy."""
        tenant = self.gpu.take_tenant_fault(self.pid)
        if tenant is None:
            return
        pid, nbytes = tenant
        record = model.Proc(pid, psutil.Process(pid).create_time(), context=nbytes)
        self.gpu.publish(record)

    def touch(self) -> None:
        """Create the context: charged at once, visible to every process's ``free``."""
        with self._lock, self.gpu.locked():
            me = model.touch(self.device, self._me, self._others())
            self.gpu.publish(me)
            self._me = me

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """One request: its activations while it runs, then kept in the pool until a sleep."""
        faults = self.gpu.faults(self.pid)
        with self._lock, self.gpu.locked():
            self._sync_weights(locked=True)
            me, taken = model.serve_begin(self.device, self._me, self._others())
            self._commit(me)
        try:
            if faults.slow_serving_s > 0:
                time.sleep(faults.slow_serving_s)
            yield
        finally:
            with self._lock:
                self._commit(model.serve_end(self._me, taken))

    def release_cached(self) -> None:
        """After a sleep: the pool goes back, but a ``leak_on_sleep`` fault keeps its bytes."""
        faults = self.gpu.faults(self.pid)
        with self._lock:
            before = self._me.weights
            self._sync_weights()
            freed = before - self._me.weights
            self._commit(model.release_cached(self._me, faults, freed))

    def read(self) -> Reading:
        with self._lock:
            self._sync_weights()
            me = self._me
        procs = [me, *self._others()]
        unlisted = self.gpu.faults(self.pid).unlisted  # NVML does not list this pid
        device = DeviceReading(
            device=f"cuda:{self.ordinal}",
            index=self.device.index,
            uuid=self.device.uuid,
            used=0 if unlisted else me.used,
            free=model.free(self.device, procs),
            total=self.device.total,
        )
        return Reading((device,), self.source)

    def close(self) -> None:
        """The process leaves the device (its exit frees everything, as a driver does)."""
        self.gpu.withdraw(self.pid)


class EngineTreeGpuProbe(FakeGpuProbe):
    """A vLLM worker on a simulated GPU: it takes no context of its own and measures its
    engine's process tree (the stand-in engine core is a child process with its own record),
    recognising the engine by the pids that appeared when the tree is not listed (as NVML does
    with host pids)."""

    def __init__(self, gpu: FakeGpu, pid: int | None = None) -> None:
        # its own process tree is walked here, in this PID namespace (it publishes no record)
        super().__init__(gpu, pid=os.getpid() if pid is None else pid)
        self.engine_pids: set[int] = set()

    def touch(self) -> None:
        """No context: the engine's process takes its own."""

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """The engine's KV cache and activations are in its own record."""
        yield

    def release_cached(self) -> None:
        """The engine's process frees its own memory."""

    def listed_pids(self) -> set[int]:
        return set(self.gpu.live())

    def adopt_engine(self, before: set[int]) -> None:
        live = self.gpu.live()
        if process_tree(self.pid) & live.keys():
            return
        self.engine_pids = set(live) - before

    def read(self) -> Reading:
        procs = self.gpu.live()
        mine = process_tree(self.pid) | self.engine_pids
        device = DeviceReading(
            device=f"cuda:{self.device.index}",
            index=self.device.index,
            uuid=self.device.uuid,
            used=sum(p.used for pid, p in procs.items() if pid in mine),
            free=model.free(self.device, procs.values()),
            total=self.device.total,
        )
        return Reading((device,), self.source)


def from_env(config: WorkerConfig) -> FakeGpuProbe | DeviceProbes:
    """The seam's factory: the simulated GPUs named by ``$OMNISTAGE_FAKE_GPU`` (for a vLLM
    worker, whose engine is the stand-in in ``tests/fakevllm``: its engine's process tree).

    It lists one device directory per device the pod sees, comma-separated (as
    ``CUDA_VISIBLE_DEVICES`` lists devices); the worker uses the first ``--gpus`` of them.
    """
    directories = [d for d in os.environ.get(ENV, "").split(",") if d.strip()]
    directory = directories[0].strip() if directories else ""
    if not directory:
        raise ValueError(f"{ENV} is not set: it names the simulated GPU's directory")
    if config.backend == "vllm":
        return EngineTreeGpuProbe(FakeGpu(Path(directory)))
    if config.device.is_cuda:
        raise ValueError(f"{ENV}: a simulated GPU is for --device cpu workers")
    if len(directories) < config.gpus:
        raise ValueError(f"{ENV} lists {len(directories)} device(s), --gpus is {config.gpus}")
    if config.gpus == 1:
        return FakeGpuProbe(FakeGpu(Path(directories[0].strip())))
    return DeviceProbes(
        [
            FakeGpuProbe(FakeGpu(Path(d.strip())), ordinal=i)
            for i, d in enumerate(directories[: config.gpus])
        ]
    )
