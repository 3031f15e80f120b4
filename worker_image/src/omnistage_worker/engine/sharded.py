"""A stage's weights over several devices: one weight engine (one flat buffer) per device.

Each device's engine owns the slots placed there (:mod:`.placement`); a transition runs on
every device at once, so the host<->device copies of the devices overlap (each device has its
own copy engines and PCIe link). A level-1 sleep or wake is issued from the calling thread,
every device's pieces interleaved, each device's on its own current stream (:mod:`.copy_jobs`:
one thread per device ran at 0.90 of one device alone, and collapsed beside a busy Python
thread); other transitions (level 2, a sleep with rebound weights) run one thread per device.
The transition waits for every device; one that fails fails the whole (the others have moved;
the worker measures each device and reports each in its Ack).

On a CPU the devices are simulated: every shard's ``torch.device`` is ``cpu``, but each keeps
its own flat buffer, host copy and byte accounting, which a simulated GPU per device charges.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from omnistage_worker.engine.copy_jobs import CopyJob, JobError, run_jobs
from omnistage_worker.engine.flat_weights import EngineError, WeightFiles
from omnistage_worker.engine.placement import DeviceMap, assign_ordinals
from omnistage_worker.engine.slots import Slot, collect_slots
from omnistage_worker.engine.weights import TransferStats, WeightEngine


class ShardedEngine:
    """One :class:`WeightEngine` per device; the same protocol as a single engine."""

    def __init__(
        self,
        modules: Mapping[str, torch.nn.Module],
        devices: Sequence[torch.device],
        device_map: DeviceMap,
        files: WeightFiles | None = None,
        *,
        pin_in_background: bool = True,
        reload_threads: int | None = None,
        slots: Sequence[Slot] | None = None,
        host_copy: bool = True,
    ) -> None:
        if not devices:
            raise EngineError("no devices to place the weights on")
        self.devices = [torch.device(d) for d in devices]
        self.slots = list(slots) if slots is not None else collect_slots(modules)
        assign_ordinals(self.slots, device_map)
        readers = reload_threads or None
        self.shards: list[WeightEngine] = []
        for ordinal, device in enumerate(self.devices):
            mine = [s for s in self.slots if s.ordinal == ordinal]
            if not mine:
                raise EngineError(f"the device map leaves device {ordinal} ({device}) empty")
            self.shards.append(
                WeightEngine(
                    modules,
                    device,
                    files,
                    pin_in_background=pin_in_background,
                    reload_threads=readers,
                    slots=mine,
                    host_copy=host_copy,
                )
            )
        self._pool = ThreadPoolExecutor(len(self.shards), thread_name_prefix="omnistage-device")
        self.last: list[TransferStats] = []
        """Each device's stats of the last transition (in device order)."""

    # ---- introspection -------------------------------------------------------------------

    @property
    def level(self) -> int:
        return max(s.level for s in self.shards)

    @property
    def weights_bytes(self) -> int:
        return sum(s.weights_bytes for s in self.shards)

    @property
    def flat_bytes(self) -> int:
        return sum(s.flat_bytes for s in self.shards)

    def device_bytes(self) -> int:
        return sum(s.device_bytes() for s in self.shards)

    def device_bytes_on(self, ordinal: int) -> int:
        """Bytes the model holds on device ``ordinal`` now."""
        return self.shards[ordinal].device_bytes()

    def host_bytes(self) -> int:
        return sum(s.host_bytes() for s in self.shards)

    # ---- transitions ---------------------------------------------------------------------

    def _all(self, step: Callable[[WeightEngine], TransferStats]) -> TransferStats:
        """``step`` on every device at once; waits for all, then raises the first failure."""
        started = time.perf_counter()
        futures: list[Future[TransferStats]] = [self._pool.submit(step, s) for s in self.shards]
        errors = [f.exception() for f in futures]
        for ordinal, error in enumerate(errors):
            if error is not None:
                raise EngineError(f"device {ordinal} ({self.devices[ordinal]}): {error}") from error
        self.last = [f.result() for f in futures]
        return TransferStats(
            sum(s.bytes_moved for s in self.last),
            time.perf_counter() - started,
            noop=all(s.noop for s in self.last),
        )

    def _together(self, job: Callable[[WeightEngine], CopyJob]) -> TransferStats:
        """Every device's copy job from this thread (:func:`run_jobs`); each device's seconds
        run from the transition's start to the end of its own finish."""
        started = time.perf_counter()
        try:
            stats = run_jobs([functools.partial(job, s) for s in self.shards])
        except JobError as error:
            where = (
                f"device {error.index} ({self.devices[error.index]})"
                if error.index >= 0
                else "the devices' copies"
            )
            raise EngineError(f"{where}: {error.error}") from error.error
        self.last = [TransferStats(s.bytes_moved, s.ended - started) for s in stats]
        return TransferStats(sum(s.bytes_moved for s in self.last), time.perf_counter() - started)

    def activate(self) -> TransferStats:
        return self._all(lambda s: s.activate())

    def start_asleep(self, level: int) -> TransferStats:
        return self._all(lambda s: s.start_asleep(level))

    def sleep(self, level: int) -> TransferStats:
        if level == 1 and all(s.can_sleep_by_job() for s in self.shards):
            return self._together(lambda s: s.sleep_job())
        return self._all(lambda s: s.sleep(level))

    def wake(self) -> TransferStats:
        if all(s.level == 1 for s in self.shards):
            return self._together(lambda s: s.wake_job())
        return self._all(lambda s: s.wake())

    def close(self) -> None:
        try:
            for shard in self.shards:
                shard.close()
        finally:
            self._pool.shutdown(wait=True)
