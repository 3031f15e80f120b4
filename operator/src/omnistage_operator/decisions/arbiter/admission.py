"""Admission: the order stages are admitted in, and who fits the group's memory (pure)."""

from __future__ import annotations

from collections.abc import Mapping

from omnistage_operator.decisions.arbiter import (
    Blocker,
    BlockReason,
    GroupMemory,
    StageFacts,
    StageIntent,
    WorkerPhase,
)
from omnistage_operator.decisions.arbiter.demand import _fmt, _usable_by_device, stage_devices
from omnistage_operator.decisions.arbiter.footprints import DeviceNeed


def admission_order(intents: Mapping[str, StageIntent]) -> list[str]:
    """Stages that want Active: priority desc, then most recent ask first, then name."""
    wanting = [i for i in intents.values() if i.want_active]
    wanting.sort(key=lambda i: (-i.priority, -i.requested_active_at, i.name))
    return [i.name for i in wanting]


def claim_too_small(intent: StageIntent, memory: GroupMemory) -> Blocker | None:
    """A ``ClaimTooSmall`` blocker when the stage needs more GPUs than the group's allocated
    claim holds (None otherwise, or while the claim's devices are unknown)."""
    claim = memory.claim_uuids
    if claim is None or intent.gpus <= len(claim):
        return None
    return Blocker(
        BlockReason.CLAIM_TOO_SMALL,
        f"needs {intent.gpus} GPUs; the group's claim holds {len(claim)} (sized for the largest "
        "stage when the group started, never resized under running pods): delete the group's "
        "stages and apply them again to size it anew",
    )


def _admit(  # noqa: PLR0917 - private helper of plan
    intents: Mapping[str, StageIntent],
    facts: Mapping[str, StageFacts],
    memory: GroupMemory,
    needs: Mapping[str, DeviceNeed | None],
    off_device: frozenset[str],
    waiting: dict[str, list[Blocker]],
) -> list[str]:
    admitted: list[str] = []
    charged: list[str] = []  # admitted stages that take device memory
    capacity = memory.capacity
    usable = _usable_by_device(intents, facts, memory)
    left: dict[str, int] | None = None
    caps: dict[str, int] = {}
    if capacity is not None:
        caps = {d.uuid: d.total for d in memory.devices} or {"": capacity}
        left = {k: cap if usable is None else min(cap, usable[k]) for k, cap in caps.items()}
    for name in admission_order(intents):
        fact = facts[name]
        if name in off_device:
            admitted.append(name)  # host RAM only: no charge on the group's GPUs
            continue
        too_small = claim_too_small(intents[name], memory)
        if too_small is not None:
            waiting[name].append(too_small)
            continue
        if fact.phase is WorkerPhase.FAILED:
            waiting[name].append(
                Blocker(BlockReason.WORKER_FAILED, "own worker failed; it is fenced first")
            )
            continue
        if fact.fence_pending:
            waiting[name].append(
                Blocker(BlockReason.FENCE_PENDING, "own pod's fence is not confirmed yet")
            )
            continue
        if fact.ack_contradicted:
            waiting[name].append(
                Blocker(BlockReason.ACK_CONTRADICTED, f"own sleep ACK {fact.ack_contradicted}")
            )
            continue
        need = needs[name]
        if capacity is None or left is None:
            if charged:
                waiting[name].append(
                    Blocker(
                        BlockReason.MEMORY_CLAIMED,
                        f"device capacity not measured yet; {charged[0]} goes first",
                        charged[0],
                    )
                )
            else:
                admitted.append(name)
                charged.append(name)
            continue
        over = [d for d, n in (need or {}).items() if n > caps.get(d, capacity)]
        if over:
            d = over[0]
            assert need is not None
            where = f" on {d}" if d else ""
            waiting[name].append(
                Blocker(
                    BlockReason.TOO_LARGE,
                    f"footprint {_fmt(need[d])}{where} exceeds the device capacity "
                    f"{_fmt(caps.get(d, capacity))}",
                    device=d,
                    needed=need[d],
                )
            )
            continue
        # Unknown footprint: the stage needs the whole group (alone, and first). The first
        # stage in order is admitted even when the usable memory does not cover it (it waits on
        # the measured free memory, and the stages after it sleep). Each of the stage's devices
        # must fit; only they are charged.
        devices = stage_devices(fact, memory)
        if not charged or (need is not None and all(need[d] <= left[d] for d in devices)):
            admitted.append(name)
            charged.append(name)
            for d in devices:
                left[d] = max(0, left[d] - (left[d] if need is None else need[d]))
            continue
        # The device where the stage falls shortest (need - left), named with its figures.
        tightest = max(devices, key=lambda d: (need[d] if need else left[d] + 1) - left[d])
        where = f" on {tightest}" if len(left) > 1 else ""
        needed = None if need is None else need[tightest]
        for other in charged:
            held = (needs[other] or {}).get(tightest) if needs[other] is not None else None
            waiting[name].append(
                Blocker(
                    BlockReason.MEMORY_CLAIMED,
                    f"{other} (priority {intents[other].priority}) claims "
                    f"{_fmt(held)}{where}; "
                    + ("footprint unknown (the whole device)" if need is None else _fmt(needed))
                    + f" needed, {_fmt(left[tightest])} left{where}",
                    other,
                    device=tightest,
                    free=left[tightest],
                    needed=needed,
                )
            )
    return admitted
