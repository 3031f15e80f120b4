"""A stage that must sleep, or whose sleep ACK is not in, blocks only wakes onto its devices."""

from __future__ import annotations

from omnistage_operator.decisions.arbiter import (
    BlockReason,
    DeviceMemory,
    GroupMemory,
    Handover,
    StageFacts,
    StageIntent,
    WorkerPhase,
)
from omnistage_operator.decisions.arbiter.plan import plan

GI = 1 << 30
TOTAL = 16 * GI


def _asleep(device: str) -> StageFacts:
    return StageFacts(WorkerPhase.ASLEEP, level=1, used_bytes=0, device_uuids=(device,))


def test_a_drain_on_one_gpu_holds_up_no_wake_on_another() -> None:
    """x drains on GPU-0 (its sleep is out); y, asleep on GPU-1, wakes at once; z, asleep on
    GPU-0, waits for x's ACK. Before, x's outstanding ACK held up every wake of the group."""
    intents = {
        "x": StageIntent("x", False, vram_request=10 * GI),
        "y": StageIntent("y", True, vram_request=4 * GI),
        "z": StageIntent("z", True, vram_request=4 * GI),
    }
    draining = StageFacts(
        WorkerPhase.SLEEPING, used_bytes=10 * GI, inflight_requests=1, device_uuids=("GPU-0",)
    )
    facts = {"x": draining, "y": _asleep("GPU-1"), "z": _asleep("GPU-0")}
    free0, free1 = TOTAL - GI - 10 * GI, TOTAL - GI
    memory = GroupMemory(
        TOTAL, free0, (DeviceMemory("GPU-0", TOTAL, free0), DeviceMemory("GPU-1", TOTAL, free1))
    )
    d = plan(intents, facts, memory, Handover("h1", frozenset({"x"})))
    assert d.wake == ("y",)
    reasons = {b.reason for b in d.waiting["z"] if b.stage == "x"}
    assert BlockReason.AWAITING_ACK in reasons
    # x's devices not reported: it may hold memory anywhere, so every wake waits
    unknown = {**facts, "x": StageFacts(WorkerPhase.SLEEPING, used_bytes=10 * GI)}
    d = plan(intents, unknown, memory, Handover("h1", frozenset({"x"})))
    assert d.wake == () and "y" in d.waiting
