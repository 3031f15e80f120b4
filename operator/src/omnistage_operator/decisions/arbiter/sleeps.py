"""Sleep choice and fencing: who must sleep, at which level, and who is fenced (pure)."""

from __future__ import annotations

from collections.abc import Mapping

from omnistage_operator.decisions.arbiter import (
    _TRANSITIONS,
    BlockReason,
    FenceOrder,
    SleepOrder,
    StageFacts,
    StageIntent,
    WorkerPhase,
)
from omnistage_operator.decisions.arbiter.demand import may_hold_memory


def _fence_order(name: str, fact: StageFacts) -> FenceOrder | None:
    if fact.phase is WorkerPhase.ABSENT:
        return None
    if fact.fence_pending:
        return FenceOrder(
            name, BlockReason.FENCE_PENDING, f"{name}'s fence is pending: its pod is not gone"
        )
    if fact.ack_contradicted:
        return FenceOrder(
            name,
            BlockReason.ACK_CONTRADICTED,
            f"{name}'s sleep ACK is contradicted by the device: {fact.ack_contradicted}",
        )
    if fact.phase is WorkerPhase.FAILED:
        return FenceOrder(name, BlockReason.WORKER_FAILED, f"{name}'s worker failed")
    return None


def _sleeps_and_fences(
    intents: Mapping[str, StageIntent],
    facts: Mapping[str, StageFacts],
    admitted: frozenset[str],
    off_device: frozenset[str],
) -> tuple[list[SleepOrder], list[FenceOrder]]:
    """Fence what must be fenced; put every stage that may hold memory and is not admitted to
    sleep (a transition in progress is awaited, not raced); deepen a sleep below its level."""
    sleeps: list[SleepOrder] = []
    fences: list[FenceOrder] = []
    for name in sorted(intents):
        intent, fact = intents[name], facts[name]
        fence = _fence_order(name, fact)
        if fence is not None:
            fences.append(fence)
        elif name in admitted:
            continue
        elif may_hold_memory(fact):
            if fact.phase not in _TRANSITIONS:
                sleeps.append(
                    SleepOrder(
                        name,
                        intent.sleep_level,
                        releases_memory=name not in off_device,
                        drain_timeout_s=intent.drain_timeout_s,
                        inflight_requests=fact.inflight_requests,
                        held=fact.device_held,
                        context_bytes=fact.context_bytes,
                    )
                )
        elif (
            fact.phase is WorkerPhase.ASLEEP
            and fact.level is not None
            and fact.level < intent.sleep_level
        ):
            sleeps.append(SleepOrder(name, intent.sleep_level, releases_memory=False))
    return sleeps, fences
