"""The blockers common to every wake of a group: ACKs, devices, starting pods, holders (pure)."""

from __future__ import annotations

from collections.abc import Mapping

from omnistage_operator.decisions.arbiter import (
    Blocker,
    BlockReason,
    FenceOrder,
    GroupMemory,
    Handover,
    StageFacts,
    StageIntent,
    WorkerPhase,
)
from omnistage_operator.decisions.arbiter.demand import may_hold_memory


def device_mismatches(
    claim_uuids: tuple[str, ...] | None,
    facts: Mapping[str, StageFacts],
    intents: Mapping[str, StageIntent] | None = None,
) -> tuple[Blocker, ...]:
    """A ``DeviceMismatch`` blocker per GPU worker using a device outside the claim's.

    A worker uses the first ``gpus`` devices it sees, so a stage on fewer GPUs than the claim
    uses some of them. Workers that report no GPU (not reached, CPU stages) are not judged;
    without a claim (explicit placement) they must be among the widest worker's devices.
    """
    seen = {
        name: f.device_uuids
        for name, f in sorted(facts.items())
        if f.device_uuids and (intents is None or name not in intents or intents[name].gpus > 0)
    }
    if claim_uuids is None:
        if not seen:
            return ()
        widest = max(seen, key=lambda n: len(seen[n]))  # the stage on the most devices
        want, source = frozenset(seen[widest]), f"{widest}'s devices"
    else:
        want, source = frozenset(claim_uuids), "the group's claim"
    out = []
    for name, uuids in seen.items():
        if not frozenset(uuids) <= want:  # a stage on fewer GPUs uses some of the claim's
            out.append(
                Blocker(
                    BlockReason.DEVICE_MISMATCH,
                    f"{name} sees devices {sorted(uuids)}, not {source} {sorted(want)}",
                    name,
                )
            )
    return tuple(out)


def _common_blockers(
    intents: Mapping[str, StageIntent],
    facts: Mapping[str, StageFacts],
    memory: GroupMemory,
    *,
    handover: Handover | None,
    started: frozenset[str],
    fences: list[FenceOrder],
    admitted: frozenset[str],
    off_device: frozenset[str],
) -> list[Blocker]:
    """Blockers that hold for every wake in the group: outstanding ACKs, device mismatches,
    pods started this round, fences, and stages that may hold memory and are not admitted."""
    common: list[Blocker] = []
    if handover is not None:
        for other in sorted(handover.outstanding):
            msg = f"no ok sleep ACK or confirmed fence of {other} for hand-over {handover.id}"
            common.append(Blocker(BlockReason.AWAITING_ACK, msg, other))
    common.extend(device_mismatches(memory.claim_uuids, facts, intents))
    for name in sorted(started):
        msg = f"pod of {name} started in this round; its context is not measured yet"
        common.append(Blocker(BlockReason.PODS_STARTING, msg, name))
    fence_of = {f.stage: f for f in fences}
    for name in sorted(intents):
        fact = facts[name]
        if name in off_device or not may_hold_memory(fact):
            continue
        if name in fence_of:
            common.append(Blocker(fence_of[name].reason, fence_of[name].message, name))
        elif name in admitted:
            continue
        elif fact.phase is WorkerPhase.UNREACHABLE:
            msg = f"{name} does not answer and may hold memory; it is fenced before any wake"
            common.append(Blocker(BlockReason.UNREACHABLE, msg, name))
        else:
            msg = f"{name} is {fact.phase.value} and must sleep first"
            common.append(Blocker(BlockReason.MUST_SLEEP, msg, name))
    return common
