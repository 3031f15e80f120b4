"""Typed worker facts: what a worker measured, converted from its GetStatus answer and its ACKs.

Pure conversion (protobuf messages in, frozen dataclasses out) and judgement of what the
figures prove (``ack_contradiction``, ``memory_need``); no network, no clock.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from omnistage.worker.v1 import sleep_service_pb2, types_pb2
from omnistage_operator.arbiter import ComponentFacts, StageFacts, WorkerPhase

__all__ = [
    "CONTRADICTION_FLOOR_BYTES",
    "CONTRADICTION_SHARE",
    "AckFacts",
    "DeviceFigures",
    "WorkerReport",
    "ack_contradiction",
    "ack_from_proto",
    "memory_need",
    "report_from_proto",
]

# An ok sleep ACK is contradicted when the bytes it claims freed exceed what the devices' own
# free memory gained by more than max(2% of their total, 256 MiB) (issue 14's tolerance).
CONTRADICTION_SHARE = 0.02
CONTRADICTION_FLOOR_BYTES = 256 << 20
_NEED = re.compile(r"need (\d+) bytes")

_PHASES = {
    types_pb2.WORKER_STATE_LOADING: WorkerPhase.LOADING,
    types_pb2.WORKER_STATE_ACTIVE: WorkerPhase.ACTIVE,
    types_pb2.WORKER_STATE_SLEEPING: WorkerPhase.SLEEPING,
    types_pb2.WORKER_STATE_ASLEEP: WorkerPhase.ASLEEP,
    types_pb2.WORKER_STATE_WAKING: WorkerPhase.WAKING,
    types_pb2.WORKER_STATE_FAILED: WorkerPhase.FAILED,
}
_SOURCES = {
    types_pb2.MEMORY_SOURCE_NVML: "nvml",
    types_pb2.MEMORY_SOURCE_ACCOUNTING: "accounting",
}
_OPS = {types_pb2.OPERATION_SLEEP: "sleep", types_pb2.OPERATION_WAKE_UP: "wake"}


@dataclass(frozen=True)
class DeviceFigures:
    """One device's figures in an ACK (``used_*``: this process; ``free_*``: all processes) or
    in a GetStatus answer (then ``used_after``/``free_after`` are "now")."""

    uuid: str = ""  # NVML UUID (or a simulated GPU's); empty on CPU
    index: int = 0
    total: int = 0
    used_before: int = 0
    used_after: int = 0
    free_before: int = 0
    free_after: int = 0


@dataclass(frozen=True)
class AckFacts:
    """A worker's measured answer to a sleep or a wake.

    ``duration_s``/``started_at`` cover the transition only; a sleep's wait for in-flight
    requests is ``drain_s`` from ``drain_started_at`` (so the operator's own overhead is the
    wall time less ``duration_s`` less ``drain_s``).
    """

    task_id: str
    ok: bool
    op: str  # "sleep" | "wake"
    state: WorkerPhase
    level: int | None = None
    error: str = ""
    freed_bytes: int = 0
    used_before_bytes: int = 0
    used_after_bytes: int = 0
    free_after_bytes: int = 0
    total_bytes: int = 0
    source: str = ""
    duration_s: float = 0.0
    started_at: float = 0.0  # epoch seconds, worker clock
    finished_at: float = 0.0
    workers: tuple[str, ...] = ()
    replayed: bool = False
    noop: bool = False
    free_before_bytes: int = 0  # sum over devices of the device's free memory before
    devices: tuple[DeviceFigures, ...] = ()
    drain_started_at: float = 0.0  # epoch seconds, worker clock; 0: no drain
    drain_s: float = 0.0
    epoch: int = 0
    peak_active_bytes: int = 0
    residual_bound_bytes: int = 0
    bytes_moved: int = 0
    components: tuple[ComponentFacts, ...] = ()  # per pipeline component, after it
    # A wake that ran out of device memory: how much more it needed than the devices had
    # (the worker is back asleep); 0 otherwise.
    needed_bytes: int = 0

    @property
    def device_free_gain(self) -> int | None:
        """What the devices' own free memory gained across the transition (None: unmeasured)."""
        if self.devices and all(d.total > 0 for d in self.devices):
            return sum(d.free_after - d.free_before for d in self.devices)
        if self.free_before_bytes > 0 or self.free_after_bytes > 0:
            return self.free_after_bytes - self.free_before_bytes
        return None


@dataclass(frozen=True)
class WorkerReport:
    """A worker's GetStatus answer."""

    phase: WorkerPhase
    level: int | None = None
    used_bytes: int = 0
    free_bytes: int = 0
    total_bytes: int = 0
    source: str = ""
    active_footprint_bytes: int = 0
    weights_bytes: int = 0
    error: str = ""
    pod: str = ""
    node: str = ""
    last_ack: AckFacts | None = None
    devices: tuple[DeviceFigures, ...] = field(default=())
    inflight_requests: int = 0
    peak_active_bytes: int = 0
    context_bytes: int = 0
    epoch: int = 0
    drain_timeout_s: float | None = None
    components: tuple[ComponentFacts, ...] = ()  # per pipeline component (empty: undivided)

    @property
    def device_uuids(self) -> tuple[str, ...]:
        """The GPUs this worker sees (empty on CPU / accounting)."""
        return tuple(sorted(d.uuid for d in self.devices if d.uuid))

    def stage_facts(
        self, *, fence_pending: bool = False, learned_need: int | None = None
    ) -> StageFacts:
        """The arbiter's view of this report, with what the operator persisted (``status``):
        a fence started and not confirmed, and the need learned from a refused wake.

        An asleep worker whose last ok sleep ACK the device contradicted is marked
        (``ack_contradiction``): it is fenced, even by an operator that restarted since.
        """
        contradicted = None
        if self.phase is WorkerPhase.ASLEEP and self.last_ack is not None:
            contradicted = ack_contradiction(self.last_ack)
        return StageFacts(
            phase=self.phase,
            level=self.level,
            used_bytes=self.used_bytes,
            active_footprint=self.active_footprint_bytes or None,
            peak_active=self.peak_active_bytes or None,
            learned_need=learned_need,
            context_bytes=self.context_bytes or None,
            fence_pending=fence_pending,
            ack_contradicted=contradicted,
            inflight_requests=self.inflight_requests,
            device_uuids=self.device_uuids,
            components=self.components,
        )


def ack_contradiction(ack: AckFacts) -> str | None:
    """Why an ok sleep ACK is not to be trusted, or None.

    The ACK's claimed freed bytes must show in the devices' own free memory (sum over devices
    of free_after - free_before) within max(2% of the total, 256 MiB). An ACK without device
    figures, not ok, replayed-noop or of a wake is not judged here.
    """
    if not ack.ok or ack.op != "sleep" or ack.freed_bytes <= 0:
        return None
    gain = ack.device_free_gain
    if gain is None:
        return None
    total = sum(d.total for d in ack.devices) or ack.total_bytes
    tolerance = max(int(CONTRADICTION_SHARE * total), CONTRADICTION_FLOOR_BYTES)
    if ack.freed_bytes - gain <= tolerance:
        return None
    return (
        f"ACK {ack.task_id} claims {ack.freed_bytes} bytes freed but the device's free memory "
        f"gained {gain} bytes (tolerance {tolerance})"
    )


def memory_need(message: str) -> int | None:
    """The bytes a wake refused for lack of memory says it needs (``need N bytes``), or None."""
    if "not enough" not in message and "RESOURCE_EXHAUSTED" not in message:
        return None
    m = _NEED.search(message)
    return int(m.group(1)) if m else None


def _level(value: int) -> int | None:
    return int(value) if value in (1, 2) else None


def _device(d: types_pb2.DeviceMemory) -> DeviceFigures:
    return DeviceFigures(
        uuid=d.uuid,
        index=d.index,
        total=d.total_bytes,
        used_before=d.used_before_bytes,
        used_after=d.used_after_bytes,
        free_before=d.free_before_bytes,
        free_after=d.free_after_bytes,
    )


def _component(c: types_pb2.ComponentMemory) -> ComponentFacts:
    return ComponentFacts(
        name=c.name,
        weights_bytes=c.weights_bytes,
        device_bytes=c.device_bytes,
        level=_level(c.level),
    )


def ack_from_proto(ack: types_pb2.Ack) -> AckFacts:
    """Convert an ``Ack`` message."""
    total = sum(d.total_bytes for d in ack.devices)
    drain = (
        ack.drain_duration.ToTimedelta().total_seconds() if ack.HasField("drain_duration") else 0.0
    )
    return AckFacts(
        task_id=ack.task_id,
        ok=ack.ok,
        op=_OPS.get(ack.operation, "unknown"),
        state=_PHASES.get(ack.state, WorkerPhase.FAILED),
        level=_level(ack.level),
        error=ack.error,
        freed_bytes=ack.freed_bytes,
        used_before_bytes=ack.used_before_bytes,
        used_after_bytes=ack.used_after_bytes,
        free_after_bytes=ack.free_after_bytes,
        total_bytes=total,
        source=_SOURCES.get(ack.source, ""),
        duration_s=ack.duration.ToTimedelta().total_seconds() if ack.HasField("duration") else 0.0,
        started_at=ack.started_at.ToNanoseconds() / 1e9 if ack.HasField("started_at") else 0.0,
        finished_at=ack.finished_at.ToNanoseconds() / 1e9 if ack.HasField("finished_at") else 0.0,
        workers=(ack.worker.pod,) if ack.worker.pod else (),
        replayed=ack.replayed,
        noop=ack.noop,
        free_before_bytes=sum(d.free_before_bytes for d in ack.devices),
        devices=tuple(_device(d) for d in ack.devices),
        drain_started_at=(
            ack.drain_started_at.ToNanoseconds() / 1e9 if ack.HasField("drain_started_at") else 0.0
        ),
        drain_s=drain,
        epoch=ack.epoch,
        peak_active_bytes=ack.peak_active_bytes,
        residual_bound_bytes=ack.residual_bound_bytes,
        bytes_moved=ack.bytes_moved,
        components=tuple(_component(c) for c in ack.components),
        needed_bytes=ack.needed_bytes,
    )


def report_from_proto(status: sleep_service_pb2.GetStatusResponse) -> WorkerReport:
    """Convert a ``GetStatusResponse``."""
    return WorkerReport(
        phase=_PHASES.get(status.state, WorkerPhase.FAILED),
        level=_level(status.level),
        used_bytes=status.used_bytes,
        free_bytes=status.free_bytes,
        total_bytes=status.total_bytes,
        source=_SOURCES.get(status.source, ""),
        active_footprint_bytes=status.active_footprint_bytes,
        weights_bytes=status.weights_bytes,
        error=status.error,
        pod=status.worker.pod,
        node=status.worker.node,
        last_ack=ack_from_proto(status.last_ack) if status.HasField("last_ack") else None,
        devices=tuple(_device(d) for d in status.devices),
        inflight_requests=status.inflight_requests,
        peak_active_bytes=status.peak_active_bytes,
        context_bytes=status.context_bytes,
        epoch=status.epoch,
        drain_timeout_s=(
            status.drain_timeout.ToTimedelta().total_seconds()
            if status.HasField("drain_timeout")
            else None
        ),
        components=tuple(_component(c) for c in status.components),
    )
