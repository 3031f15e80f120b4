"""What a memory probe measures and the protocol every probe follows (no I/O here)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from omnistage.worker.v1 import types_pb2


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


@runtime_checkable
class EngineTreeProbe(Protocol):
    """A probe that measures an engine's processes (vLLM) and can recognise them by the pids
    the device lists (where the driver reports host pids)."""

    def listed_pids(self) -> set[int]:
        """The pids the device lists now."""
        ...

    def adopt_engine(self, before: set[int]) -> None:
        """After the engine started: recognise its pids against ``before``."""
        ...
