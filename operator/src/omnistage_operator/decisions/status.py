"""Pure assembly of an OmniStage's status from worker facts and the arbiter's decision.

Everything written here comes from what the worker measured (GetStatus, ACKs) or from what
the operator itself did (a fence); nothing is assumed from a spec.

Two facts must survive an operator restart, so they live in status and come back through
``persisted_facts``: ``fencePending`` (a fence started and not confirmed: the stage holds memory
until its pod is confirmed gone) and ``learnedNeedBytes`` (the need a wake refused for lack of
memory reported: the stage's footprint from then on).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from omnistage_operator.api import conditions as cond
from omnistage_operator.decisions.arbiter import Blocker, BlockReason, WorkerPhase
from omnistage_operator.decisions.component_status import (
    COMPONENTS_SETTLED,
    component_status,
    components_verdict,
)
from omnistage_operator.decisions.facts import AckFacts, WorkerReport
from omnistage_worker.quantities import format_bytes

__all__ = [
    "MemorySource",
    "PersistedFacts",
    "Phase",
    "StageObservation",
    "build_status",
    "format_timestamp",
    "parse_timestamp",
    "persisted_facts",
    "wait_cause",
    "waiting_for",
]


class Phase(StrEnum):
    """``status.state``: what the operator observed."""

    PENDING = "Pending"
    LOADING = "Loading"
    ACTIVE = "Active"
    SLEEPING = "Sleeping"
    ASLEEP = "Asleep"
    WAKING = "Waking"
    WAITING = "Waiting"
    FAILED = "Failed"


class MemorySource(StrEnum):
    """``status.memory.source``: how the memory figures were measured."""

    NVML = "nvml"
    ACCOUNTING = "accounting"


def format_timestamp(epoch_s: float) -> str:
    """RFC 3339 with microseconds (``requestedActiveAt``, ``lastAck.time``)."""
    return datetime.fromtimestamp(epoch_s, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_timestamp(text: str | None) -> float | None:
    """Inverse of ``format_timestamp`` (also accepts whole seconds); None when absent or bad."""
    if not text:
        return None
    for fmt in ("%Y-%m-%dT%H:%M:%S.%fZ", "%Y-%m-%dT%H:%M:%SZ"):
        try:
            return datetime.strptime(text, fmt).replace(tzinfo=UTC).timestamp()
        except ValueError:
            continue
    return None


@dataclass(frozen=True)
class StageObservation:
    """What the operator knows about one stage at the end of a round."""

    generation: int
    wants_active: bool
    phase: WorkerPhase
    report: WorkerReport | None = None
    pod: str | None = None
    node: str | None = None
    last_ack: AckFacts | None = None
    admitted: bool = False
    waiting: tuple[Blocker, ...] = ()
    fenced_reason: str | None = None
    requested_active_at: float | None = None
    sleep_level: int = 1
    waking: bool = False  # the arbiter allowed its wake; the WakeUp is going out
    worker_error: str | None = None  # why the worker could not be asked (e.g. UNAUTHENTICATED)
    fence_pending: str | None = None  # a fence started and not confirmed (why it was started)
    learned_need: int | None = None  # bytes, from a wake refused for lack of memory
    # The round's own word on this stage, as (CamelCase reason, message): a sleep that was not
    # ok (``SleepResult.reason``/``message``) and a wake that was refused or failed.
    sleep_problem: tuple[str, str] | None = None
    wake_problem: tuple[str, str] | None = None
    # Component-level sleep: the spec's asleepComponents, why they are not as asked (the
    # arbiter's blockers), and the worker's own word on a component sleep or wake that failed.
    asleep_components: tuple[str, ...] = ()
    components_waiting: tuple[Blocker, ...] = ()
    component_problem: tuple[str, str] | None = None
    # An unexpected error of this stage in a round (start, sleep, wake): (reason, message).
    stage_problem: tuple[str, str] | None = None
    # Per device UUID, the most it was measured holding while Active (``peaks.StagePeaks``).
    peaks: Mapping[str, int] | None = None
    # Why its worker's last ok sleep ACK is not trusted (``StageFacts.ack_contradicted``).
    ack_contradicted: str | None = None


@dataclass(frozen=True)
class PersistedFacts:
    """What status carries across operator restarts (see the module docstring)."""

    fence_pending: bool = False
    fence_reason: str | None = None
    learned_need: int | None = None


def persisted_facts(status: Mapping[str, Any] | None) -> PersistedFacts:
    """Read back ``fencePending`` and ``learnedNeedBytes`` from a stage's status."""
    st = status or {}
    reason = st.get("fencePending")
    need = st.get("learnedNeedBytes")
    return PersistedFacts(
        fence_pending=bool(reason),
        fence_reason=reason if isinstance(reason, str) and reason else None,
        learned_need=need if isinstance(need, int) and need > 0 else None,
    )


def _contradicted(o: StageObservation) -> str | None:
    """The contradiction of its last ok sleep ACK, while it stands: the asleep worker that sent
    it, or no new worker reached since its fence."""
    if o.ack_contradicted is not None:
        return o.ack_contradicted
    gone = o.phase in (WorkerPhase.ABSENT, WorkerPhase.STARTING, WorkerPhase.UNREACHABLE)
    if gone and o.sleep_problem is not None and o.sleep_problem[0] == cond.Reason.ACK_CONTRADICTED:
        return o.sleep_problem[1]
    return None


def _state(o: StageObservation) -> Phase:
    if _contradicted(o) is not None:
        return Phase.FAILED  # fenced like any failed sleeper, until a new worker reports
    match o.phase:
        case WorkerPhase.ACTIVE:
            return Phase.ACTIVE
        case WorkerPhase.LOADING:
            return Phase.LOADING
        case WorkerPhase.SLEEPING:
            return Phase.SLEEPING
        case WorkerPhase.WAKING:
            return Phase.WAKING
        case WorkerPhase.FAILED | WorkerPhase.UNREACHABLE:
            return Phase.FAILED
        case WorkerPhase.ASLEEP if o.waking:
            return Phase.WAKING
        case WorkerPhase.ASLEEP:
            return Phase.WAITING if o.wants_active and o.waiting else Phase.ASLEEP
        case _:
            return Phase.PENDING  # no pod yet, or its worker has not answered yet


def _ack_status(ack: AckFacts) -> dict[str, Any]:
    return {
        "taskId": ack.task_id,
        "op": ack.op,
        "ok": ack.ok,
        "level": ack.level,
        "freedBytes": ack.freed_bytes,
        "freed": format_bytes(ack.freed_bytes),  # negative for a wake: memory taken
        "usedAfterBytes": ack.used_after_bytes,
        "durationSeconds": round(ack.duration_s, 6),
        "time": format_timestamp(ack.finished_at) if ack.finished_at else None,
        "startedAt": format_timestamp(ack.started_at) if ack.started_at else None,
        "drainSeconds": round(ack.drain_s, 6) if ack.drain_s else None,
        "workers": list(ack.workers),
        "error": ack.error or None,
    }


_BLOCK_REASONS = {  # in order of precedence
    BlockReason.CLAIM_TOO_SMALL: cond.Reason.CLAIM_TOO_SMALL,
    BlockReason.DEVICE_MISMATCH: cond.Reason.DEVICE_MISMATCH,
    BlockReason.TOO_LARGE: cond.Reason.LARGER_THAN_DEVICE,
    BlockReason.ACK_CONTRADICTED: cond.Reason.ACK_CONTRADICTED,
    BlockReason.FENCE_PENDING: cond.Reason.FENCE_PENDING,
    BlockReason.WORKER_FAILED: cond.Reason.WORKER_FAILED,
    BlockReason.AWAITING_ACK: cond.Reason.WAITING_FOR_ACKS,
    BlockReason.NOT_MEASURED: cond.Reason.MEMORY_NOT_MEASURED,
    BlockReason.PODS_STARTING: cond.Reason.PODS_STARTING,
    BlockReason.FREE_TOO_LOW: cond.Reason.INSUFFICIENT_MEMORY,
    BlockReason.UNREACHABLE: cond.Reason.WAITING_FOR_STAGE,
    BlockReason.MUST_SLEEP: cond.Reason.WAITING_FOR_STAGE,
}


def wait_cause(status: Mapping[str, Any]) -> tuple[str, ...] | None:
    """What a status says a stage waits for, without the figures (reason and who): an Event
    is due when this changes, not when the figures move."""
    reason = status.get("waitReason")
    if not reason:
        return None
    names = [str(e).split(":", 1)[0].split(" (", 1)[0] for e in status.get("waitingFor") or ()]
    return (str(reason), *names)


def _waiting_reason(blockers: Sequence[Blocker]) -> cond.Reason:
    reasons = {b.reason for b in blockers}
    for block, reason in _BLOCK_REASONS.items():
        if block in reasons:
            return reason
    if BlockReason.MEMORY_CLAIMED in reasons:
        return cond.Reason.LOWER_PRIORITY
    return cond.Reason.WAITING_FOR_MEMORY


def build_status(
    o: StageObservation, previous: Mapping[str, Any] | None, now: datetime
) -> dict[str, Any]:
    """The full ``status`` for a merge patch (keys set to None are removed by the API)."""
    state = _state(o)
    gen = o.generation
    status = _fields(o, state)
    if o.report is not None:
        status["memory"] = _memory(o.report, o.last_ack)
        status["memory"]["peak"] = dict(o.peaks) if o.peaks else None
    if o.last_ack is not None:
        status["lastAck"] = _ack_status(o.last_ack)
    ready = _ready(o, state)
    cs: list[dict[str, Any]] | None = list((previous or {}).get("conditions") or [])
    for kind, (ok, reason, message) in (
        (cond.READY, ready),
        (cond.ASLEEP, _asleep(o, ready[1])),
        (cond.MEMORY_RELEASED, _memory_released(o, ready[1])),
        (cond.ADMITTED, _admitted(o)),
    ):
        cs = cond.set_condition(cs, kind, ok, reason, message, gen, now)
    parts = _components(o, cs)
    if parts is not None:
        cs = cond.set_condition(cs, COMPONENTS_SETTLED, *parts, gen, now)
    status["conditions"] = cs
    return status


def _components(o: StageObservation, cs: list[dict[str, Any]] | None) -> _Verdict | None:
    """``ComponentsSettled``: written once a stage has components asleep or asked asleep."""
    r = o.report
    verdict = components_verdict(
        o.asleep_components,
        o.phase,
        r.components if r is not None else (),
        o.components_waiting,
        o.component_problem,
    )
    if verdict is None and cond.get_condition(cs or [], COMPONENTS_SETTLED) is not None:
        return True, "ComponentsResident", "no component is asleep or asked asleep"
    return verdict


_Verdict = tuple[bool, str, str]  # a condition's status, reason and message


def _fields(o: StageObservation, state: Phase) -> dict[str, Any]:
    """The plain fields: state, level, pod, node, who blocks a wake, the persisted facts."""
    r = o.report
    blockers = _wait_blockers(o)
    waits = bool(blockers) and o.wants_active and not o.waking and state is not Phase.ACTIVE
    return {
        "observedGeneration": o.generation,
        "state": state.value,
        "sleepLevel": (r.level if r is not None and r.phase is WorkerPhase.ASLEEP else None),
        "pod": o.pod,
        "node": o.node or (r.node if r is not None and r.node else None),
        "waitingFor": waiting_for(blockers) if waits else None,
        "waitReason": _waiting_reason(blockers).value if waits else None,
        "requestedActiveAt": (
            format_timestamp(o.requested_active_at) if o.requested_active_at else None
        ),
        "fencePending": o.fence_pending or None,
        "learnedNeedBytes": o.learned_need or None,
    }


def _memory(r: WorkerReport, last_ack: AckFacts | None) -> dict[str, Any]:
    """``status.memory`` from the worker's measurement (and the last sleep's freed bytes)."""
    residual = r.used_bytes if r.phase is WorkerPhase.ASLEEP else 0
    last_freed = last_ack.freed_bytes if last_ack and last_ack.op == "sleep" else None
    return {
        "usedBytes": r.used_bytes,
        "capacityBytes": r.total_bytes,
        "freeBytes": r.free_bytes,
        "lastFreedBytes": last_freed,
        "residualBytes": residual,
        "used": format_bytes(r.used_bytes),
        "capacity": format_bytes(r.total_bytes),
        "lastFreed": format_bytes(max(last_freed, 0)) if last_freed is not None else None,
        "source": r.source or None,
        "peakActiveBytes": r.peak_active_bytes or None,
        "contextBytes": r.context_bytes or None,
        "components": component_status(r.components),
    }


def _ready(o: StageObservation, state: Phase) -> _Verdict:
    """Ready: the worker is Active; else why not, in the worker's own words where it gave any."""
    r = o.report
    ready = state is Phase.ACTIVE
    reason: str = {
        Phase.ACTIVE: cond.Reason.WORKER_READY,
        Phase.LOADING: cond.Reason.LOADING,
        Phase.WAKING: cond.Reason.WAKING,
        Phase.SLEEPING: cond.Reason.SLEEPING,
        Phase.PENDING: cond.Reason.POD_PENDING,
        Phase.FAILED: cond.Reason.WORKER_LOST
        if o.phase is WorkerPhase.UNREACHABLE
        else cond.Reason.FAILED,
    }.get(state, cond.Reason.WORKER_NOT_READY)
    message = f"worker is {o.phase.value}" + (f": {r.error}" if r is not None and r.error else "")
    if o.worker_error is not None and r is None:
        reason, message = cond.Reason.WORKER_UNAUTHENTICATED, o.worker_error
    elif o.stage_problem is not None and not ready:
        reason, message = o.stage_problem
    elif o.wake_problem is not None and not ready:
        reason, message = o.wake_problem
    return ready, reason, message


def _asleep(o: StageObservation, ready_reason: str) -> _Verdict:
    """Asleep: the worker reports asleep (acknowledged when the last sleep ACK was ok)."""
    if o.phase is not WorkerPhase.ASLEEP:
        return False, ready_reason, f"worker is {o.phase.value}"
    ack = o.last_ack
    slept_ok = ack is not None and ack.op == "sleep" and ack.ok
    reason = cond.Reason.SLEEP_ACKNOWLEDGED if slept_ok else cond.Reason.DESIRED_ASLEEP
    return True, reason, f"worker reports asleep at level {o.report.level if o.report else '?'}"


def _memory_released(o: StageObservation, ready_reason: str) -> _Verdict:
    """MemoryReleased: a pending fence, a fence, a contradicted ACK and a failed sleep first;
    then what the worker measured."""
    r = o.report
    contradicted = _contradicted(o)
    if contradicted is not None:
        return False, cond.Reason.ACK_CONTRADICTED, contradicted
    if o.fence_pending is not None and o.phase is not WorkerPhase.ABSENT:
        message = f"fence started, pod not confirmed gone: {o.fence_pending}"
        return False, cond.Reason.FENCE_PENDING, message
    if o.fenced_reason is not None:
        return True, cond.Reason.FENCED, o.fenced_reason
    if o.sleep_problem is not None and o.phase is not WorkerPhase.ABSENT:
        return False, o.sleep_problem[0], o.sleep_problem[1]
    if o.phase is WorkerPhase.ASLEEP and r is not None:
        return _asleep_memory(r, o.last_ack)
    if o.phase is WorkerPhase.ABSENT or o.phase is WorkerPhase.STARTING:
        return True, cond.Reason.POD_PENDING, "no worker holds memory"
    used = format_bytes(r.used_bytes) if r is not None else "unknown"
    return False, ready_reason, f"worker holds {used}"


def _asleep_memory(r: WorkerReport, ack: AckFacts | None) -> _Verdict:
    """MemoryReleased of an asleep worker: verified from its measurement, unless its last
    sleep ACK was not ok."""
    if ack is not None and ack.op == "sleep" and not ack.ok:
        return False, cond.Reason.ACK_FAILED, f"sleep ACK {ack.task_id} not ok: {ack.error}"
    message = f"measured {format_bytes(r.used_bytes)} used on the device ({r.source})"
    if ack is not None and ack.op == "sleep" and ack.ok:
        message += f"; ACK {ack.task_id} freed {format_bytes(max(ack.freed_bytes, 0))}"
    return True, cond.Reason.MEMORY_VERIFIED, message


def _admitted(o: StageObservation) -> _Verdict:
    """Admitted: to the group's memory and nothing stops its wake; else asleep by spec, or what
    blocks it (a stage first in order whose wake the gate refuses is not admitted yet: the
    reason says why, with the figures)."""
    if not o.wants_active and not o.admitted:
        return False, cond.Reason.DESIRED_ASLEEP, "spec.state is Asleep"
    blockers = _wait_blockers(o)
    if o.admitted and (not blockers or o.phase is WorkerPhase.ACTIVE or o.waking):
        return True, cond.Reason.ADMITTED, "admitted to the group's memory"
    message = "; ".join(b.message for b in blockers) or "waiting"
    if o.admitted:
        message = f"first in the group's order, not woken: {message}"
    return False, _waiting_reason(blockers), message


def _wait_blockers(o: StageObservation) -> tuple[Blocker, ...]:
    """The blockers that make the stage wait on something (its own transition is not one)."""
    return tuple(b for b in o.waiting if b.reason is not BlockReason.SELF_BUSY)


def waiting_for(blockers: Sequence[Blocker]) -> list[str]:
    """``status.waitingFor``: what a stage waits for, each entry naming one cause.

    A stage in the way is named alone (``sd``); a device short of memory is named by who holds
    it, with the figures: ``sd: 13.1 GiB on GPU-1 (free 7.7 GiB, needed 16.6 GiB)`` and
    ``other tenants: ...`` for processes outside the group (the device's used memory less what
    the group's workers report); a blocker with neither is named by its reason.
    """
    out: list[str] = []
    for b in blockers:
        if b.stage:
            entry = b.stage
        elif b.holders:
            where = f" on {b.device}" if b.device else ""
            figures = f"free {format_bytes(b.free or 0)}, needed {format_bytes(b.needed or 0)}"
            for holder, nbytes in b.holders:
                entry = f"{holder}: {format_bytes(nbytes)}{where} ({figures})"
                if entry not in out:
                    out.append(entry)
            continue
        elif b.device is not None and b.needed is not None:
            where = f" on {b.device}" if b.device else ""
            free = f"free {format_bytes(b.free)}, " if b.free is not None else ""
            entry = f"memory{where} ({free}needed {format_bytes(b.needed)})"
        else:
            entry = str(b.reason.value)
        if entry not in out:
            out.append(entry)
    return out
