"""Acks: measured answers to Sleep and WakeUp, and the bounded memory of task ids."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime

from omnistage.worker.v1 import types_pb2
from omnistage_worker.config import Identity
from omnistage_worker.memory import Reading


@dataclass(frozen=True)
class Outcome:
    """What a transition did, before it is written as an Ack."""

    task_id: str
    operation: types_pb2.Operation.ValueType
    state: types_pb2.WorkerState.ValueType
    level: int
    before: Reading
    after: Reading
    started_at: datetime
    finished_at: datetime
    seconds: float
    bytes_moved: int = 0
    noop: bool = False
    error: str = ""
    residual_bound: int = 0
    epoch: int = 0
    peak_active: int = 0
    # A sleep that waited for in-flight requests: when it began waiting and for how long
    # (started_at, finished_at and seconds cover the transition after that wait).
    drain_started_at: datetime | None = None
    drain_seconds: float = 0.0
    # A wake that ran out of device memory: how much more it needed than the devices had.
    needed_bytes: int = 0


def identity_proto(identity: Identity) -> types_pb2.WorkerIdentity:
    """The worker's identity as written into Acks and statuses."""
    return types_pb2.WorkerIdentity(
        stage=identity.stage,
        namespace=identity.namespace,
        pod=identity.pod,
        rank=identity.rank,
        node=identity.node,
        pid=identity.pid,
    )


def device_figures(before: Reading, after: Reading) -> list[types_pb2.DeviceMemory]:
    """Per-device figures; devices are matched by name."""
    prior = {d.device: d for d in before.devices}
    out = []
    for dev in after.devices:
        earlier = prior.get(dev.device, dev)
        used_before = earlier.used
        out.append(
            types_pb2.DeviceMemory(
                device=dev.device,
                index=dev.index,
                uuid=dev.uuid,
                used_before_bytes=used_before,
                used_after_bytes=dev.used,
                freed_bytes=used_before - dev.used,
                free_after_bytes=dev.free,
                total_bytes=dev.total,
                free_before_bytes=earlier.free,
            )
        )
    return out


def build_ack(outcome: Outcome, identity: Identity) -> types_pb2.Ack:
    """Write an :class:`Outcome` as an Ack; the sums are the sums of the per-device figures."""
    devices = device_figures(outcome.before, outcome.after)
    ack = types_pb2.Ack(
        task_id=outcome.task_id,
        ok=not outcome.error,
        error=outcome.error,
        operation=outcome.operation,
        level=level_proto(outcome.level),
        state=outcome.state,
        freed_bytes=sum(d.freed_bytes for d in devices),
        used_before_bytes=sum(d.used_before_bytes for d in devices),
        used_after_bytes=sum(d.used_after_bytes for d in devices),
        free_after_bytes=sum(d.free_after_bytes for d in devices),
        devices=devices,
        source=outcome.after.source,
        worker=identity_proto(identity),
        noop=outcome.noop,
        residual_bound_bytes=outcome.residual_bound,
        bytes_moved=outcome.bytes_moved,
        epoch=outcome.epoch,
        peak_active_bytes=outcome.peak_active,
        needed_bytes=outcome.needed_bytes,
    )
    ack.duration.FromNanoseconds(int(outcome.seconds * 1e9))
    ack.started_at.FromDatetime(outcome.started_at)
    ack.finished_at.FromDatetime(outcome.finished_at)
    if outcome.drain_started_at is not None:
        ack.drain_started_at.FromDatetime(outcome.drain_started_at)
        ack.drain_duration.FromNanoseconds(int(outcome.drain_seconds * 1e9))
    return ack


def level_proto(level: int) -> types_pb2.SleepLevel.ValueType:
    """A sleep level (0: awake) as the proto enum."""
    if level == 1:
        return types_pb2.SLEEP_LEVEL_OFFLOAD
    if level == 2:
        return types_pb2.SLEEP_LEVEL_DISCARD
    return types_pb2.SLEEP_LEVEL_UNSPECIFIED


def replayed(ack: types_pb2.Ack) -> types_pb2.Ack:
    """A copy of ``ack`` marked as returned again for a repeated task id."""
    copy = types_pb2.Ack()
    copy.CopyFrom(ack)
    copy.replayed = True
    return copy


class TaskIdConflict(ValueError):
    """A task id was reused for a different request."""


@dataclass
class _Entry:
    key: str
    task: asyncio.Future[types_pb2.Ack]


class AckCache:
    """Bounded LRU of task id -> the transition started for it (a future of its Ack).

    A repeated id joins the first transition (still running or done) instead of starting a
    second one. ``key`` describes the request (operation and level) so that reusing an id for
    a different request is refused rather than answered with an unrelated Ack.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, _Entry] = OrderedDict()

    def get(self, task_id: str, key: str) -> asyncio.Future[types_pb2.Ack] | None:
        entry = self._entries.get(task_id)
        if entry is None:
            return None
        if entry.key != key:
            raise TaskIdConflict(f"task_id {task_id!r} was already used for {entry.key}, not {key}")
        self._entries.move_to_end(task_id)
        return entry.task

    def put(self, task_id: str, key: str, task: asyncio.Future[types_pb2.Ack]) -> None:
        self._entries[task_id] = _Entry(key, task)
        self._entries.move_to_end(task_id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def discard(self, task_id: str) -> None:
        self._entries.pop(task_id, None)

    def __len__(self) -> int:
        return len(self._entries)
