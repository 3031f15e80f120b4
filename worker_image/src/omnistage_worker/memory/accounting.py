"""CPU: exact tensor accounting of the engine's device bytes, against the host's memory."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import psutil

from omnistage.worker.v1 import types_pb2
from omnistage_worker.memory.base import DeviceReading, Reading


class AccountingProbe:
    """CPU figures from exact tensor accounting (``used_fn`` sums the weight tensors).

    ``capacity`` is the device's size (default: the host's memory); ``free`` is what this
    process leaves of it (a simulated device shared by processes, in the test harness,
    subclasses this probe).
    """

    source = types_pb2.MEMORY_SOURCE_ACCOUNTING

    def __init__(
        self,
        used_fn: Callable[[], int],
        capacity: int | None = None,
        *,
        device: str = "cpu",
        index: int = 0,
    ) -> None:
        self._used_fn = used_fn
        self.capacity = capacity if capacity is not None else psutil.virtual_memory().total
        self.device_name = device
        self.device_index = index

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
        device = DeviceReading(
            self.device_name, self.device_index, "", used, self.capacity - used, self.capacity
        )
        return Reading((device,), self.source)

    def close(self) -> None:
        """Nothing to give back."""
