"""Component sleeps and wakes of a group's admitted Active stages (pure)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from omnistage_operator.decisions.arbiter import (
    Blocker,
    BlockReason,
    GroupMemory,
    SleepOrder,
    StageFacts,
    StageIntent,
    WorkerPhase,
)
from omnistage_operator.decisions.arbiter.demand import _fmt, _largest, usable_memory
from omnistage_operator.decisions.arbiter.footprints import DeviceNeed


@dataclass
class _Parts:
    """Component orders of one plan, before the wake gate."""

    sleeps: list[SleepOrder] = field(default_factory=list)
    wakes: dict[str, int] = field(default_factory=dict)  # stage: bytes its wake adds
    waiting: dict[str, list[Blocker]] = field(default_factory=dict)


def _components(  # noqa: PLR0917 - private helper of plan
    intents: Mapping[str, StageIntent],
    facts: Mapping[str, StageFacts],
    memory: GroupMemory,
    needs: Mapping[str, DeviceNeed | None],
    admitted: list[str],
    off_device: frozenset[str],
) -> _Parts:
    """Sleeps and wakes of components of admitted Active stages (see the module docstring)."""
    parts = _Parts()
    room = _room(intents, facts, memory, needs, admitted, off_device)
    for name in admitted:
        intent, fact = intents[name], facts[name]
        if fact.phase is not WorkerPhase.ACTIVE or not (
            intent.asleep_components or fact.asleep_components
        ):
            continue
        known = {c.name for c in fact.components}
        unknown = sorted(intent.asleep_components - known)
        if unknown:
            have = ", ".join(sorted(known)) or "none (one undivided model)"
            msg = f"spec.asleepComponents names {', '.join(unknown)}; the worker has {have}"
            parts.waiting[name] = [Blocker(BlockReason.UNKNOWN_COMPONENTS, msg)]
            continue
        to_wake = fact.asleep_components - intent.asleep_components
        to_sleep = intent.asleep_components - fact.asleep_components
        if to_wake:
            growth = sum(
                max(0, c.weights_bytes - c.device_bytes)
                for c in fact.components
                if c.name in fact.asleep_components
            )
            if name not in off_device and room is not None and growth > room:
                msg = (
                    f"waking {', '.join(sorted(fact.asleep_components))} takes {_fmt(growth)}; "
                    f"the group's admitted stages leave {_fmt(room)}"
                )
                parts.waiting[name] = [Blocker(BlockReason.NO_ROOM, msg)]
                continue
            parts.wakes[name] = 0 if name in off_device else growth
            if room is not None and name not in off_device:
                room -= growth
        elif to_sleep:
            parts.sleeps.append(
                SleepOrder(
                    name,
                    intent.sleep_level,
                    releases_memory=name not in off_device,
                    drain_timeout_s=intent.drain_timeout_s,
                    inflight_requests=fact.inflight_requests,
                    components=tuple(sorted(to_sleep)),
                )
            )
    return parts


def _room(  # noqa: PLR0917 - private helper of plan
    intents: Mapping[str, StageIntent],
    facts: Mapping[str, StageFacts],
    memory: GroupMemory,
    needs: Mapping[str, DeviceNeed | None],
    admitted: list[str],
    off_device: frozenset[str],
) -> int | None:
    """Per device, what the admitted stages' footprints leave of the group's memory (None:
    not measured; 0 when a footprint is unknown: such a stage takes the whole group)."""
    capacity = memory.capacity
    if capacity is None:
        return None
    usable = usable_memory(intents, facts, memory)
    left = capacity if usable is None else min(capacity, usable)
    for name in admitted:
        if name in off_device:
            continue
        need = _largest(needs[name])
        if need is None:
            return 0
        left -= need
    return max(0, left)
