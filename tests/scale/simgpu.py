"""Simulated GPUs held in one process: the :mod:`tests.fakegpu` physics, records in memory.

The simulated worker host (:mod:`tests.scale.simhost`) runs many workers in one process, so the
device records cannot be keyed by pid and kept in files as :mod:`tests.fakegpu.device` does:
here each worker has its own record (a synthetic pid in the pure model), and a device is shared
by every worker of the host that sees it (localnode gives a node's pods to one host). The rules
are :mod:`tests.fakegpu.model`'s: a driver reserve, a context per worker at its first touch,
the engine's device bytes as weights (a growth that does not fit is a CUDA-worded OOM),
activations per request kept until the sleep's ``release_cached``, and a stopped worker's
record removed (as the driver frees a killed process's memory). Faults are not simulated.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import threading
from collections.abc import Iterator
from pathlib import Path

from omnistage.worker.v1 import types_pb2
from omnistage_worker.config import WorkerConfig
from omnistage_worker.memory import AccountingProbe, DeviceReading, Reading
from tests.fakegpu import model

# synthetic pids, far above any real one, so the pure model tells workers apart
_PIDS = itertools.count(10_000_000)


class SimGpu:
    """One simulated device shared by the workers of this process (thread-safe)."""

    def __init__(self, device: model.Device) -> None:
        self.device = device
        self.records: dict[int, model.Proc] = {}
        self.lock = threading.Lock()

    @classmethod
    def from_dir(cls, directory: Path) -> SimGpu:
        """The device a localnode device directory describes (its ``device.json``)."""
        return cls(model.Device.from_json(json.loads((directory / "device.json").read_text())))

    def others(self, pid: int) -> list[model.Proc]:
        return [p for q, p in self.records.items() if q != pid]

    def free(self) -> int:
        """Free memory now (reserve and every worker's charge taken)."""
        return model.free(self.device, self.records.values())


class SimGpuProbe(AccountingProbe):
    """One worker on one :class:`SimGpu` (an AccountingProbe: the worker feeds it its engine)."""

    source = types_pb2.MEMORY_SOURCE_ACCOUNTING

    def __init__(self, gpu: SimGpu, ordinal: int = 0) -> None:
        super().__init__(lambda: 0, capacity=gpu.device.total)
        self.gpu = gpu
        self.ordinal = ordinal
        self.pid = next(_PIDS)
        self._me = model.Proc(self.pid, 0.0)

    @property
    def record(self) -> model.Proc:
        """What the device charges this worker now."""
        return self._me

    def _commit(self, me: model.Proc) -> None:
        self._me = me
        self.gpu.records[self.pid] = me

    def _sync_weights(self) -> None:
        """Charge the engine's device bytes now (call with the device lock held)."""
        weights = self._used_fn()
        if weights != self._me.weights:
            others = self.gpu.others(self.pid)
            self._commit(model.copy_weights(self.gpu.device, self._me, others, weights))

    def touch(self) -> None:
        with self.gpu.lock:
            self._commit(model.touch(self.gpu.device, self._me, self.gpu.others(self.pid)))

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        with self.gpu.lock:
            self._sync_weights()
            me, taken = model.serve_begin(self.gpu.device, self._me, self.gpu.others(self.pid))
            self._commit(me)
        try:
            yield
        finally:
            with self.gpu.lock:
                self._commit(model.serve_end(self._me, taken))

    def release_cached(self) -> None:
        with self.gpu.lock:
            before = self._me.weights
            self._sync_weights()
            freed = before - self._me.weights
            self._commit(model.release_cached(self._me, model.Faults(), freed))

    def read(self) -> Reading:
        with self.gpu.lock:
            self._sync_weights()
            device = DeviceReading(
                device=f"cuda:{self.ordinal}",
                index=self.gpu.device.index,
                uuid=self.gpu.device.uuid,
                used=self._me.used,
                free=self.gpu.free(),
                total=self.gpu.device.total,
            )
        return Reading((device,), self.source)

    def close(self) -> None:
        """The worker leaves the device: everything it held is freed."""
        with self.gpu.lock:
            self.gpu.records.pop(self.pid, None)


class Devices:
    """The host's simulated GPUs by device directory, and which worker sees which."""

    def __init__(self) -> None:
        self._gpus: dict[str, SimGpu] = {}
        self._workers: dict[str, list[SimGpu]] = {}
        self._lock = threading.Lock()

    def gpu(self, directory: str) -> SimGpu:
        with self._lock:
            gpu = self._gpus.get(directory)
            if gpu is None:
                gpu = self._gpus[directory] = SimGpu.from_dir(Path(directory))
            return gpu

    def assign(self, target: str, directories: list[str]) -> None:
        """The worker listening on ``target`` (``host:port``) sees these devices, in order."""
        gpus = [self.gpu(d) for d in directories]
        with self._lock:
            self._workers[target] = gpus

    def release(self, target: str) -> None:
        with self._lock:
            self._workers.pop(target, None)

    def probe(self, config: WorkerConfig) -> SimGpuProbe:
        """The probe of the worker ``config`` describes (its devices were assigned first)."""
        target = f"{config.host}:{config.port}"
        with self._lock:
            gpus = self._workers.get(target)
        if not gpus:
            raise ValueError(f"the simulated host assigned no device to the worker at {target}")
        if config.gpus != 1:
            raise ValueError(f"{target}: the simulated host runs one-device stages only")
        return SimGpuProbe(gpus[0])


DEVICES = Devices()


def probe_for(config: WorkerConfig) -> SimGpuProbe:
    """The worker's memory-probe seam (``OMNISTAGE_MEMORY_PROBE=tests.scale.simgpu:probe_for``)."""
    return DEVICES.probe(config)
