"""A stage's weights over several devices: one weight engine (one flat buffer) per device.

Each device's engine owns the slots placed there (:mod:`.placement`); a transition runs on
every device at once, one thread per device, so the host<->device copies of the devices
overlap (each device has its own copy engines and PCIe link). The transition waits for every
device; one that fails fails the whole (the others have moved; the worker measures each device
and reports each in its Ack).

On a CPU the devices are simulated: every shard's ``torch.device`` is ``cpu``, but each keeps
its own flat buffer, host copy and byte accounting, which a simulated GPU per device charges.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from omnistage_worker.engine.flat_weights import WAKE_STREAMS, EngineError, WeightFiles
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
        wake_streams: int = WAKE_STREAMS,
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
                    wake_streams=wake_streams,
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

    def activate(self) -> TransferStats:
        return self._all(lambda s: s.activate())

    def start_asleep(self, level: int) -> TransferStats:
        return self._all(lambda s: s.start_asleep(level))

    def sleep(self, level: int) -> TransferStats:
        return self._all(lambda s: s.sleep(level))

    def wake(self) -> TransferStats:
        return self._all(lambda s: s.wake())

    def close(self) -> None:
        try:
            for shard in self.shards:
                shard.close()
        finally:
            self._pool.shutdown(wait=True)
