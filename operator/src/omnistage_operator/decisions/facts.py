"""Typed worker facts: what a worker measured, converted from its GetStatus answer and its ACKs.

Pure conversion (protobuf messages in, frozen dataclasses out) and judgement of what the
figures prove (``ack_contradiction``, ``memory_need``); no network, no clock.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from omnistage.worker.v1 import sleep_service_pb2, types_pb2
from omnistage_operator.decisions.arbiter import ComponentFacts, StageFacts, WorkerPhase

__all__ = [
    "CONTRADICTION_FLOOR_BYTES",
    "CONTRADICTION_SHARE",
    "OVERLAPPED_SLEEP",
    "AckFacts",
    "DeviceFigures",
    "RoomBeside",
    "WorkerReport",
    "ack_contradiction",
    "ack_from_proto",
    "memory_need",
    "report_from_proto",
]

# An ok sleep ACK is contradicted when, on one of its devices, the bytes that left by its
# figures exceed what that device's own free memory gained by more than max(2% of the
# device's total, 256 MiB) (issue 14's tolerance, now per device).
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
    weights: int = 0  # the stage's weights its device map places here (resident or not)


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
    sequential: bool = False  # one component resident at a time, inside requests
    claim_limits: bool = False  # takes part in an overlapped hand-over (GetStatus.claim_limits)
    handoff: bool = False  # hands device pieces over in one (GetStatus.handoff)

    @property
    def device_uuids(self) -> tuple[str, ...]:
        """The GPUs this worker sees (empty on CPU / accounting)."""
        return tuple(sorted(d.uuid for d in self.devices if d.uuid))

    def stage_facts(
        self,
        *,
        fence_pending: bool = False,
        learned_need: int | None = None,
        device_peaks: Mapping[str, int] | None = None,
        device_held: Mapping[str, int] | None = None,
    ) -> StageFacts:
        """The arbiter's view of this report, with what the operator persisted (``status``):
        a fence started and not confirmed, the need learned from a refused wake, the per-device
        peaks kept across wakes (``peaks.StagePeaks.kept``) and what the worker was seen
        holding per device since its last wake (``held``: the next sleep order carries it, and
        its ok ACK must show it leaving the device; not judged for a sequential pipeline, whose
        components come and go inside requests).

        An asleep worker whose last ok sleep ACK the device contradicted is marked
        (``ack_contradiction``): it is fenced, even by an operator that restarted since.
        """
        held = None if self.sequential else device_held
        contradicted = None
        if self.phase is WorkerPhase.ASLEEP and self.last_ack is not None:
            # Judged on its own figures here: what was seen held since the wake is judged
            # when the ACK arrives (``SleepOrder.held``), not against a later deepening's ACK.
            contradicted = ack_contradiction(
                self.last_ack, None, self.context_bytes or None, rejudged=True
            )
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
            device_used={d.uuid: d.used_after for d in self.devices if d.uuid},
            device_peaks=dict(device_peaks or {}),
            device_weights={d.uuid: d.weights for d in self.devices if d.uuid and d.weights},
            device_held=dict(held or {}),
            claim_limits=self.claim_limits,
            handoff=self.handoff,
        )


@dataclass(frozen=True)
class RoomBeside:
    """A streamed sleep's first report: its device's free memory, measured by its worker before
    the sleep gave anything back (the room beside the sleeping stage)."""

    free_bytes: int


def _ended_first(wake: AckFacts, sleep: AckFacts) -> bool:
    """Whether the wake beside ended before the sleep did, by the workers' clocks (one node's;
    unknown when either is unstamped: then the wake's end is the later one)."""
    return 0 < wake.finished_at < sleep.finished_at


def _span(wake_first: bool) -> str:
    """How far a gain judged with the wake beside ran (``ack_contradiction``'s message)."""
    if wake_first:
        return " with what the wake beside it took"
    return " to the end of the wake beside it, with what that took"


OVERLAPPED_SLEEP = "-overlapped"
"""The end of an overlapped sleep's task id (``handover.overlap``). Its ACK's device figures are
judged once, by the round that sent it, against the wake that ran beside it (``beside``); a later
reading of the ACK (``rejudged``) judges only what the worker holds asleep."""


def ack_contradiction(
    ack: AckFacts,
    held: Mapping[str, int] | None = None,
    context_bytes: int | None = None,
    *,
    beside: AckFacts | None = None,
    rejudged: bool = False,
) -> str | None:
    """Why an ok sleep ACK is not to be trusted, or None.

    Judged per device (never summed across devices, also when the ACK claims 0 freed), against
    the device's own free memory in the worker's after-reading, within a tolerance of
    max(2% of that device's total, 256 MiB) (issue 14's bound: allocator slack, a context,
    another process's small allocation meanwhile; the worker's own residual slack is 128 MiB):

    - what left the device by the ACK's figures (its "before", or more when the operator saw
      the worker hold more on that device since its last wake: ``held``, by device UUID, of a
      worker that went to sleep whole) less its "after" must show as a gain of the device's
      free memory (free after - free before);
    - a worker asleep whole must hold no more than its context (``context_bytes``, the sum over
      its devices, measured at its start) on each device.

    ``beside``: the ACK of the wake that ran beside this sleep on the same device (an
    overlapped hand-over). The device's gain is then measured from this sleep's start to the
    later of the two ends (the wake's, unless the workers' clocks say it ended first: a small
    wake that fitted in the room beside), and what the wake took meanwhile (its own used after
    less before) is counted as freed by this sleep: the figures of both workers must add up.
    ``rejudged``: a later reading of the ACK; an overlapped sleep's is then judged only on what
    the worker holds.

    An ACK that is not ok, of a wake, or without per-device figures (its sums are judged then)
    is not judged per device here.
    """
    if not ack.ok or ack.op != "sleep":
        return None
    gains = not (rejudged and ack.task_id.endswith(OVERLAPPED_SLEEP))
    woke = {b.uuid: b for b in beside.devices if b.total > 0} if beside is not None else {}
    wake_first = beside is not None and _ended_first(beside, ack)
    whole = str(ack.state) == "Asleep"
    measured = [d for d in ack.devices if d.total > 0]
    problems: list[str] = []
    if not measured:
        gain = ack.device_free_gain
        if gain is None or ack.freed_bytes <= 0 or not gains:
            return None
        if beside is not None:
            if not wake_first:
                gain += beside.free_after_bytes - ack.free_after_bytes
            gain += beside.used_after_bytes - beside.used_before_bytes
        tolerance = max(int(CONTRADICTION_SHARE * ack.total_bytes), CONTRADICTION_FLOOR_BYTES)
        if ack.freed_bytes - gain > tolerance:
            problems.append(
                f"claims {ack.freed_bytes} bytes freed but the device's free memory gained "
                f"{gain} bytes (tolerance {tolerance})"
            )
    seen = held if whole and held else {}
    context = (context_bytes or 0) // max(1, len(measured)) if context_bytes else None
    for d in measured:
        name = d.uuid or f"device {d.index}"
        tolerance = max(int(CONTRADICTION_SHARE * d.total), CONTRADICTION_FLOOR_BYTES)
        before = max(d.used_before, seen.get(d.uuid, 0))
        left = before - d.used_after
        gain = d.free_after - d.free_before
        other = woke.get(d.uuid)
        if other is not None:  # to the later end of the two, with what the wake took meanwhile
            end_free = d.free_after if wake_first else other.free_after
            gain = end_free - d.free_before + other.used_after - other.used_before
        if gains and left - gain > tolerance:
            was = (
                f"held {before} bytes (seen by the operator; the ACK says {d.used_before})"
                if before > d.used_before
                else f"held {before} bytes"
            )
            problems.append(
                f"on {name} the worker {was} and {d.used_after} after, so {left} bytes must "
                f"have left the device (the ACK claims {d.used_before - d.used_after} freed), "
                f"but its free memory gained {gain} bytes"
                + (_span(wake_first) if other is not None else "")
                + f" (tolerance {tolerance})"
            )
        if whole and context is not None and d.used_after - context > tolerance:
            problems.append(
                f"on {name} the worker still holds {d.used_after} bytes asleep, more than its "
                f"context {context} (tolerance {tolerance})"
            )
    if not problems:
        return None
    return f"ACK {ack.task_id} " + "; ".join(problems)


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
        weights=d.weights_bytes,
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
        sequential=status.sequential,
        claim_limits=status.claim_limits,
        handoff=status.handoff,
    )
