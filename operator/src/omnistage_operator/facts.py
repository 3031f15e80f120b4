"""Typed worker facts: what a worker measured, converted from its GetStatus answer and its ACKs.

Pure conversion (protobuf messages in, frozen dataclasses out); no network.
"""

from __future__ import annotations

from dataclasses import dataclass

from omnistage.worker.v1 import sleep_service_pb2, types_pb2
from omnistage_operator.arbiter import StageFacts, WorkerPhase

__all__ = [
    "AckFacts",
    "WorkerReport",
    "ack_from_proto",
    "report_from_proto",
]

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
class AckFacts:
    """A worker's measured answer to a sleep or a wake."""

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

    def stage_facts(self) -> StageFacts:
        """The arbiter's view of this report."""
        return StageFacts(
            phase=self.phase,
            level=self.level,
            used_bytes=self.used_bytes,
            active_footprint=self.active_footprint_bytes or None,
        )


def _level(value: int) -> int | None:
    return int(value) if value in (1, 2) else None


def ack_from_proto(ack: types_pb2.Ack) -> AckFacts:
    """Convert an ``Ack`` message."""
    total = sum(d.total_bytes for d in ack.devices)
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
    )
