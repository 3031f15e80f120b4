"""Status assembly from worker facts (pure)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from omnistage_operator.arbiter import Blocker, BlockReason, WorkerPhase
from omnistage_operator.facts import AckFacts, WorkerReport
from omnistage_operator.status import (
    StageObservation,
    build_status,
    format_timestamp,
    parse_timestamp,
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
    assert _cond(st, "Admitted")["status"] == "True"


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
