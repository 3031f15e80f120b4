"""Status assembly from worker facts (pure)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from omnistage_operator.decisions.arbiter import Blocker, BlockReason, WorkerPhase
from omnistage_operator.decisions.facts import AckFacts, DeviceFigures, WorkerReport
from omnistage_operator.decisions.status import (
    StageObservation,
    build_status,
    format_timestamp,
    parse_timestamp,
    persisted_facts,
)

NOW = datetime(2026, 11, 21, 5, 0, tzinfo=UTC)
LATER = datetime(2026, 11, 21, 5, 1, tzinfo=UTC)
GI = 1 << 30


def _cond(status: dict[str, Any], type_: str) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == type_)


def test_asleep_after_ok_ack_shows_figures_and_conditions() -> None:
    ack = AckFacts(
        "h1-a-sleep1", True, "sleep", WorkerPhase.ASLEEP, level=1, freed_bytes=6 * GI,
        used_after_bytes=0, duration_s=0.25, started_at=1.0e9, finished_at=1.0e9 + 0.25,
        workers=("a-worker",), source="nvml",
    )  # fmt: skip
    rep = WorkerReport(
        WorkerPhase.ASLEEP, level=1, used_bytes=0, free_bytes=80 * GI, total_bytes=80 * GI,
        source="nvml", node="gpu-0",
    )  # fmt: skip
    obs = StageObservation(
        generation=3, wants_active=False, phase=WorkerPhase.ASLEEP, report=rep,
        pod="a-worker", last_ack=ack,
    )  # fmt: skip
    st = build_status(obs, None, NOW)
    assert st["state"] == "Asleep" and st["sleepLevel"] == 1 and st["observedGeneration"] == 3
    assert st["node"] == "gpu-0" and st["pod"] == "a-worker"
    assert st["lastAck"]["taskId"] == "h1-a-sleep1" and st["lastAck"]["freed"] == "6Gi"
    assert st["lastAck"]["ok"] is True and st["lastAck"]["workers"] == ["a-worker"]
    assert st["memory"]["used"] == "0" and st["memory"]["capacity"] == "80Gi"
    assert st["memory"]["source"] == "nvml" and st["memory"]["lastFreedBytes"] == 6 * GI
    assert _cond(st, "Asleep")["status"] == "True"
    assert _cond(st, "Asleep")["reason"] == "SleepAcknowledged"
    assert _cond(st, "MemoryReleased")["reason"] == "MemoryVerified"
    assert _cond(st, "Ready")["status"] == "False"
    assert _cond(st, "Admitted")["reason"] == "DesiredAsleep"
    assert all(c["observedGeneration"] == 3 for c in st["conditions"])

    # Same facts later: the transition times stay.
    again = build_status(obs, st, LATER)
    assert again["conditions"] == st["conditions"]


def test_waiting_stage_names_its_blockers() -> None:
    rep = WorkerReport(WorkerPhase.ASLEEP, level=2, total_bytes=GI, free_bytes=0)
    blockers = (
        Blocker(BlockReason.AWAITING_ACK, "no ok sleep ACK from b", "b"),
        Blocker(BlockReason.MUST_SLEEP, "c is Active and must sleep first", "c"),
    )
    obs = StageObservation(
        generation=1, wants_active=True, phase=WorkerPhase.ASLEEP, report=rep,
        admitted=True, waiting=blockers, requested_active_at=1.7e9,
    )  # fmt: skip
    st = build_status(obs, None, NOW)
    assert st["state"] == "Waiting"
    assert st["waitingFor"] == ["b", "c"]
    assert parse_timestamp(st["requestedActiveAt"]) == 1.7e9
    # First in the group's order, but not woken: Admitted says why (not "admitted").
    admitted = _cond(st, "Admitted")
    assert (admitted["status"], admitted["reason"]) == ("False", "WaitingForAcks")
    assert "no ok sleep ACK from b" in admitted["message"]
    assert st["waitReason"] == "WaitingForAcks"


def test_active_and_fenced_and_lost() -> None:
    rep = WorkerReport(WorkerPhase.ACTIVE, used_bytes=GI, total_bytes=4 * GI, free_bytes=3 * GI)
    st = build_status(
        StageObservation(1, True, WorkerPhase.ACTIVE, report=rep, admitted=True), None, NOW
    )
    assert st["state"] == "Active" and _cond(st, "Ready")["status"] == "True"
    assert _cond(st, "MemoryReleased")["status"] == "False"
    fenced = build_status(
        StageObservation(1, False, WorkerPhase.ABSENT, fenced_reason="sleep h1 failed"), st, LATER
    )
    assert _cond(fenced, "MemoryReleased")["reason"] == "Fenced"
    assert _cond(fenced, "Ready")["lastTransitionTime"] == "2026-11-21T05:01:00Z"
    lost = build_status(StageObservation(1, True, WorkerPhase.UNREACHABLE), st, LATER)
    assert lost["state"] == "Failed" and _cond(lost, "Ready")["reason"] == "WorkerLost"


def test_timestamps_round_trip_with_microseconds() -> None:
    t = 1795238919.251666
    assert abs((parse_timestamp(format_timestamp(t)) or 0) - t) < 1e-6
    assert parse_timestamp("2026-11-21T05:00:00Z") is not None
    assert parse_timestamp("yesterday") is None


def test_allowed_wake_shows_waking() -> None:
    rep = WorkerReport(WorkerPhase.ASLEEP, level=1, total_bytes=GI, free_bytes=GI)
    obs = StageObservation(1, True, WorkerPhase.ASLEEP, report=rep, admitted=True, waking=True)
    assert build_status(obs, None, NOW)["state"] == "Waking"


def test_lying_ack_is_not_memory_released() -> None:
    """Issue 14: an ok sleep ACK the device's figures contradict used to read
    MemoryReleased=True ("measured ... used on the device")."""
    dev = DeviceFigures("GPU-0", 0, 80 * GI, 16 * GI, 0, 10 * GI, 10 * GI)
    ack = AckFacts(
        "h1-a-sleep1", True, "sleep", WorkerPhase.ASLEEP, level=1, freed_bytes=16 * GI,
        devices=(dev,), free_before_bytes=10 * GI, free_after_bytes=10 * GI,
    )  # fmt: skip
    rep = WorkerReport(WorkerPhase.ASLEEP, level=1, total_bytes=80 * GI, last_ack=ack)
    why = rep.stage_facts().ack_contradicted  # the arbiter's facts say it; status shows it
    obs = StageObservation(1, False, WorkerPhase.ASLEEP, report=rep, last_ack=ack,
                           ack_contradicted=why)  # fmt: skip
    st = build_status(obs, None, NOW)
    mr = _cond(st, "MemoryReleased")
    assert (mr["status"], mr["reason"]) == ("False", "AckContradicted")
    assert "gained 0" in mr["message"] and "GPU-0" in mr["message"]
    assert st["state"] == "Failed"  # fenced like any failed sleeper


def test_pending_fence_and_learned_need_persist_and_read_back() -> None:
    obs = StageObservation(
        1, True, WorkerPhase.UNREACHABLE, fence_pending="sleep h1 failed",
        learned_need=20 * GI,
        waiting=(Blocker(BlockReason.TOO_LARGE, "footprint 20Gi exceeds 16Gi"),),
    )  # fmt: skip
    st = build_status(obs, None, NOW)
    assert st["fencePending"] == "sleep h1 failed" and st["learnedNeedBytes"] == 20 * GI
    assert _cond(st, "MemoryReleased")["reason"] == "FencePending"
    assert _cond(st, "Admitted")["reason"] == "LargerThanDevice"
    back = persisted_facts(st)
    assert back.fence_pending and back.learned_need == 20 * GI
    assert persisted_facts({}) == persisted_facts(None) and not persisted_facts({}).fence_pending
    cleared = build_status(StageObservation(1, True, WorkerPhase.ABSENT), st, LATER)
    assert cleared["fencePending"] is None  # a merge patch removes it


def test_round_problems_become_conditions() -> None:
    rep = WorkerReport(WorkerPhase.ACTIVE, used_bytes=GI, total_bytes=4 * GI)
    obs = StageObservation(
        1, False, WorkerPhase.ACTIVE, report=rep,
        sleep_problem=("SleepRefused", "refused (FAILED_PRECONDITION): level: 2 unsupported"),
    )  # fmt: skip
    mr = _cond(build_status(obs, None, NOW), "MemoryReleased")
    assert (mr["reason"], mr["status"]) == ("SleepRefused", "False") and "level: 2" in mr["message"]
    rep = WorkerReport(WorkerPhase.ASLEEP, level=1, total_bytes=4 * GI)
    obs = StageObservation(
        1, True, WorkerPhase.ASLEEP, report=rep, wake_problem=("WakeRefused", "not enough memory"),
        waiting=(Blocker(BlockReason.NOT_MEASURED, "no free figure"),),
    )  # fmt: skip
    st = build_status(obs, None, NOW)
    assert _cond(st, "Ready")["reason"] == "WakeRefused"
    assert _cond(st, "Admitted")["reason"] == "MemoryNotMeasured"


def test_a_stage_on_more_gpus_than_the_claim_reads_claim_too_small() -> None:
    blocker = Blocker(BlockReason.CLAIM_TOO_SMALL, "needs 2 GPUs; the group's claim holds 1")
    obs = StageObservation(1, True, WorkerPhase.ASLEEP, waiting=(blocker,))
    admitted = _cond(build_status(obs, None, NOW), "Admitted")
    assert (admitted["status"], admitted["reason"]) == ("False", "ClaimTooSmall")
    assert "needs 2 GPUs" in admitted["message"]
