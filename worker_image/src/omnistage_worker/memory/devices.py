"""A stage on several devices: one probe per device, read together into one Reading."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

from omnistage.worker.v1 import types_pb2
from omnistage_worker.memory.accounting import AccountingProbe
from omnistage_worker.memory.base import MemoryProbe, Reading


class DeviceProbes:
    """The probes of a stage's devices, in device order; a reading lists every device."""

    def __init__(self, probes: Sequence[MemoryProbe]) -> None:
        if not probes:
            raise ValueError("no device probes")
        sources = {p.source for p in probes}
        if len(sources) != 1:
            raise ValueError(f"device probes disagree on their source: {sorted(sources)}")
        self.probes = list(probes)
        self.source: types_pb2.MemorySource.ValueType = probes[0].source

    @property
    def unverified(self) -> str:
        """Why some device's per-process figures cannot be trusted ("" when all can)."""
        return "; ".join(
            f"{i}: {why}"
            for i, p in enumerate(self.probes)
            if (why := getattr(p, "unverified", ""))
        )

    def touch(self) -> None:
        """Every device's context; the first device last, so it ends up the current one."""
        for probe in reversed(self.probes):
            probe.touch()

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for probe in self.probes:
                stack.enter_context(probe.serving())
            yield

    def release_cached(self) -> None:
        for probe in self.probes:
            probe.release_cached()

    def read(self) -> Reading:
        readings = [p.read() for p in self.probes]
        return Reading(tuple(d for r in readings for d in r.devices), self.source)

    def close(self) -> None:
        for probe in self.probes:
            probe.close()

    def set_used_fns(self, used_fns: Sequence[Callable[[], int]]) -> None:
        """Point each accounting probe at its device's engine bytes (device order)."""
        if len(used_fns) != len(self.probes):
            raise ValueError(f"{len(used_fns)} accountings for {len(self.probes)} devices")
        for probe, used_fn in zip(self.probes, used_fns, strict=True):
            if isinstance(probe, AccountingProbe):
                probe.set_used_fn(used_fn)


def feed_accounting(probe: MemoryProbe, device_bytes: Sequence[Callable[[], int]]) -> None:
    """Accounting probes count the engine's bytes: each device's own, or the sum on one."""
    if isinstance(probe, DeviceProbes):
        probe.set_used_fns(device_bytes)
    elif isinstance(probe, AccountingProbe):
        total = list(device_bytes)
        probe.set_used_fn(total[0] if len(total) == 1 else lambda: sum(f() for f in total))
