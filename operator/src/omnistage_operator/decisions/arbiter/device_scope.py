"""Which of a group's common blockers hold for one wake (pure logic, used by ``arbiter.plan``).

Most blockers hold for every wake of the group: a pending fence, a lying ACK, an unreachable or
failed worker, pods starting, a device mismatch (what such a stage holds, and where, is not
known). Two are scoped to devices: a stage that must sleep first (``MUST_SLEEP``) and a sleeper
of the hand-over without its ok ACK yet (``AWAITING_ACK``) hold memory only on the devices its
worker reports, so they block only a wake onto one of those devices. A stage whose devices are
not reported is on every device of the group. A wake onto another device still passes the wake
gate on its own devices' measured free memory; so a stage draining a long request on one GPU
holds up no wake on another GPU of its group, and its own device opens only after its ACK.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from omnistage_operator.decisions.arbiter.blockers import Blocker, BlockReason

if TYPE_CHECKING:
    from omnistage_operator.decisions.arbiter import GroupMemory, StageFacts

__all__ = ["PER_DEVICE", "blockers_for"]

PER_DEVICE = frozenset({BlockReason.AWAITING_ACK, BlockReason.MUST_SLEEP})


def _devices_of(fact: StageFacts | None, memory: GroupMemory) -> frozenset[str]:
    known = frozenset(d.uuid for d in memory.devices)
    mine = known & frozenset(fact.device_uuids) if fact is not None else frozenset()
    return mine or known


def blockers_for(
    common: Sequence[Blocker],
    name: str,
    devices: Sequence[str],
    facts: Mapping[str, StageFacts],
    memory: GroupMemory,
) -> list[Blocker]:
    """The common blockers that hold for a wake of ``name`` onto ``devices``."""
    onto = frozenset(devices)
    out: list[Blocker] = []
    for b in common:
        if b.stage == name:
            continue
        scoped = b.reason in PER_DEVICE and b.stage is not None and memory.gpu
        if scoped and not _devices_of(facts.get(b.stage or ""), memory) & onto:
            continue  # it holds nothing on the devices this wake goes to
        out.append(b)
    return out
