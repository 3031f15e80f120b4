"""The worker as its parts see it: what each part reads and changes of the one ``Worker``.

:class:`~omnistage_worker.state.Worker` owns loading, the transitions, GetStatus and the
metrics and hands itself to each; they are typed against these protocols, not against
``Worker``, so none imports the module that imports it (no circle, typing-only ones included).
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from omnistage.worker.v1 import types_pb2
from omnistage_worker.config import Identity, WorkerConfig
from omnistage_worker.control.demand import Demand
from omnistage_worker.control.lane import DaemonLane
from omnistage_worker.control.queued import Queued
from omnistage_worker.control.transitions import Current
from omnistage_worker.memory import MemoryProbe, Reading
from omnistage_worker.runners.base import ModelRunner, SleepController

__all__ = ["AckCounter", "WorkerParts", "WorkerReadings"]


class WorkerReadings(Protocol):
    """What the worker's reports read of it: GetStatus (:mod:`.status`) and the metrics."""

    config: WorkerConfig
    runner: ModelRunner
    identity: Identity
    controller: SleepController | None
    baseline: int
    active_footprint: int
    peak_active: int
    epoch: int
    error: str
    last_ack: types_pb2.Ack | None
    demand: Demand
    queued: Queued

    @property
    def state(self) -> types_pb2.WorkerState.ValueType: ...

    @property
    def level(self) -> int: ...

    @property
    def inflight(self) -> int: ...

    def snapshot(self) -> Reading | None: ...


class AckCounter(Protocol):
    """The metric every Ack is counted into."""

    def acked(self, ack: types_pb2.Ack) -> None: ...


class WorkerParts(WorkerReadings, Protocol):
    """What loading (:mod:`.loading`) and the transitions (:mod:`.transition_acks`,
    :mod:`.sleep_wake`) read and change of the worker."""

    probe: MemoryProbe | None
    baselines: dict[str, int]
    transition_lane: DaemonLane
    loaded: asyncio.Event
    idle: asyncio.Event

    @property
    def metrics(self) -> AckCounter: ...

    @property
    def current(self) -> Current: ...

    @property
    def residual_bound(self) -> int: ...

    async def set_state(self, state: types_pb2.WorkerState.ValueType, level: int) -> None: ...

    async def fail(self, error: str, level: int | None = None, residual: bool = False) -> None: ...

    def clear_residual_failure(self) -> None: ...

    def require_controller(self) -> SleepController: ...

    def measure(self) -> Reading: ...

    def note_peak(self, reading: Reading) -> None: ...

    def release_cached(self) -> None: ...
