"""The colocation-group arbiter: who may hold GPU memory, who must sleep first, who waits and why.

Pure logic: no I/O, no kopf, no clock. ``plan`` takes the group's stage intents (from specs), the
facts its workers measured, the latest measured free/capacity of the group's devices and the
bookkeeping of the hand-over in progress, and returns a ``Decision``.

Rules (the operator's promise rests on them):

- Admission: stages that want Active are ordered by priority (higher first), then by when they
  asked (the most recent ask first, so ``kubectl patch`` of ``spec.state`` switches the awake
  stage), then by name. Walking that order, a stage is admitted when its footprint fits the
  capacity left by the stages admitted before it. The footprint is the active footprint its
  worker measured on its last wake, else ``vram.request``, else the whole device. While the
  capacity is unknown (no worker measured it yet) only the first stage is admitted.
- Every stage that is not admitted and may hold memory gets a sleep order at its spec's level,
  except while its worker is Loading, Sleeping or Waking: that transition is awaited first.
  A stage may hold memory unless its pod is absent (API confirmed), it is a pod created asleep
  that was never reached, or its worker reported Asleep. An unreachable worker holds memory
  until it is fenced (its pod deleted and the deletion confirmed).
- Pods are always created asleep (so a restarted container never takes memory on its own); a
  wake of an admitted, measured-asleep stage is allowed only when every stage
  that had to sleep in this hand-over has an ok sleep ACK or is fenced, no stage outside the
  admitted set may hold memory, and the latest measured free memory covers the footprint plus
  a margin (capped at the capacity). Wakes in one decision are charged against the free figure
  one after the other.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

__all__ = [
    "BlockReason",
    "Blocker",
    "Decision",
    "GroupMemory",
    "Handover",
    "SleepOrder",
    "StageFacts",
    "StageIntent",
    "WorkerPhase",
    "admission_order",
    "footprint",
    "may_hold_memory",
    "plan",
]


class WorkerPhase(StrEnum):
    """What the operator knows about a stage's worker."""

    ABSENT = "Absent"  # no pod, or its deletion confirmed by the API server
    STARTING = "Starting"  # pod created asleep, worker not reached yet
    UNREACHABLE = "Unreachable"  # pod exists, worker does not answer (may hold memory)
    LOADING = "Loading"
    ACTIVE = "Active"
    SLEEPING = "Sleeping"
    ASLEEP = "Asleep"
    WAKING = "Waking"
    FAILED = "Failed"


_NOT_HOLDING = frozenset({WorkerPhase.ABSENT, WorkerPhase.STARTING, WorkerPhase.ASLEEP})
_IN_PROGRESS = frozenset({WorkerPhase.LOADING, WorkerPhase.WAKING})
_TRANSITIONS = _IN_PROGRESS | {WorkerPhase.SLEEPING}


@dataclass(frozen=True)
class StageIntent:
    """What a stage's spec asks for, reduced to what the arbiter needs."""

    name: str
    want_active: bool
    priority: int = 0
    requested_active_at: float = 0.0  # epoch seconds of the latest ask for Active
    sleep_level: int = 1
    vram_request: int | None = None


@dataclass(frozen=True)
class StageFacts:
    """What the stage's worker measured (or that it could not be reached)."""

    phase: WorkerPhase
    level: int | None = None  # sleep level while asleep
    used_bytes: int = 0
    active_footprint: int | None = None  # measured after the worker's last wake or load


@dataclass(frozen=True)
class GroupMemory:
    """The latest measured capacity and free memory of the group's devices (sums)."""

    capacity: int | None = None
    free: int | None = None


@dataclass(frozen=True)
class Handover:
    """Bookkeeping of the hand-over in progress: who had to sleep, who ACKed ok, who was fenced."""

    id: str
    sleepers: frozenset[str] = frozenset()
    acked: frozenset[str] = frozenset()
    fenced: frozenset[str] = frozenset()

    @property
    def outstanding(self) -> frozenset[str]:
        """Sleepers with neither an ok ACK nor a confirmed fence."""
        return self.sleepers - self.acked - self.fenced


class BlockReason(StrEnum):
    """Why a stage that wants Active is not woken now."""

    MEMORY_CLAIMED = "MemoryClaimed"  # admitted stages before it take the memory
    TOO_LARGE = "LargerThanDevice"  # its footprint exceeds the whole capacity
    MUST_SLEEP = "HoldsMemory"  # a stage outside the admitted set still holds memory
    AWAITING_ACK = "AwaitingSleepAck"  # a sleeper of this hand-over has no ok ACK yet
    UNREACHABLE = "Unreachable"  # a holder does not answer; it is fenced before any wake
    FREE_TOO_LOW = "MeasuredFreeTooLow"  # measured free memory does not cover the footprint
    SELF_BUSY = "Transitioning"  # its own worker is starting, loading, sleeping or failed


@dataclass(frozen=True)
class Blocker:
    """One reason a stage waits; ``stage`` names the stage in the way, if any."""

    reason: BlockReason
    message: str
    stage: str | None = None


@dataclass(frozen=True)
class SleepOrder:
    """Put ``stage`` to sleep at ``level``; ``releases_memory`` is False for a 1->2 deepening."""

    stage: str
    level: int
    releases_memory: bool = True


@dataclass(frozen=True)
class Decision:
    """The arbiter's answer for one group."""

    admitted: tuple[str, ...]
    sleep: tuple[SleepOrder, ...]
    wake: tuple[str, ...]
    waiting: Mapping[str, tuple[Blocker, ...]] = field(default_factory=dict)
    footprints: Mapping[str, int | None] = field(default_factory=dict)

    @property
    def holder_sleeps(self) -> frozenset[str]:
        """Stages whose sleep must be ACKed before any wake."""
        return frozenset(o.stage for o in self.sleep if o.releases_memory)

    def waiting_for(self, stage: str) -> tuple[str, ...]:
        """Names of the stages blocking ``stage``, in order, without repeats."""
        names: list[str] = []
        for blocker in self.waiting.get(stage, ()):
            if blocker.stage is not None and blocker.stage not in names:
                names.append(blocker.stage)
        return tuple(names)


def may_hold_memory(facts: StageFacts) -> bool:
    """Whether a stage's worker may hold device memory, as far as measured facts tell."""
    return facts.phase not in _NOT_HOLDING


def footprint(intent: StageIntent, facts: StageFacts, capacity: int | None) -> int | None:
    """Measured active footprint, else ``vram.request``, else the capacity (None: unknown)."""
    if facts.active_footprint is not None and facts.active_footprint > 0:
        return facts.active_footprint
    if intent.vram_request is not None:
        return intent.vram_request
    return capacity


def admission_order(intents: Mapping[str, StageIntent]) -> list[str]:
    """Stages that want Active: priority desc, then most recent ask first, then name."""
    wanting = [i for i in intents.values() if i.want_active]
    wanting.sort(key=lambda i: (-i.priority, -i.requested_active_at, i.name))
    return [i.name for i in wanting]


def _fmt(n: int | None) -> str:
    if n is None:
        return "unknown"
    for unit, size in (("Gi", 1 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n}B"


def _admit(
    intents: Mapping[str, StageIntent],
    facts: Mapping[str, StageFacts],
    memory: GroupMemory,
    fps: Mapping[str, int | None],
    waiting: dict[str, list[Blocker]],
) -> list[str]:
    admitted: list[str] = []
    capacity = memory.capacity
    left = capacity
    for name in admission_order(intents):
        fp = fps[name]
        if capacity is None or left is None:
            if admitted:
                waiting[name].append(
                    Blocker(
                        BlockReason.MEMORY_CLAIMED,
                        f"device capacity not measured yet; {admitted[0]} goes first",
                        admitted[0],
                    )
                )
            else:
                admitted.append(name)
            continue
        if fp is not None and fp > capacity:
            waiting[name].append(
                Blocker(
                    BlockReason.TOO_LARGE,
                    f"footprint {_fmt(fp)} exceeds the group's capacity {_fmt(capacity)}",
                )
            )
            continue
        need = capacity if fp is None else fp
        if need <= left:
            admitted.append(name)
            left -= need
            continue
        for other in admitted:
            waiting[name].append(
                Blocker(
                    BlockReason.MEMORY_CLAIMED,
                    f"{other} (priority {intents[other].priority}) claims "
                    f"{_fmt(fps[other])}; {_fmt(need)} needed, {_fmt(left)} left",
                    other,
                )
            )
    return admitted


def plan(
    intents: Mapping[str, StageIntent],
    facts: Mapping[str, StageFacts],
    memory: GroupMemory,
    handover: Handover | None = None,
    *,
    margin_bytes: int = 0,
) -> Decision:
    """Decide sleeps, wakes and waits for one group (see the module docstring for the rules)."""
    absent = StageFacts(WorkerPhase.ABSENT)
    facts = {name: facts.get(name, absent) for name in intents}
    fps = {name: footprint(intents[name], facts[name], memory.capacity) for name in intents}
    waiting: dict[str, list[Blocker]] = {name: [] for name in intents}

    admitted = _admit(intents, facts, memory, fps, waiting)
    admitted_set = frozenset(admitted)

    sleeps: list[SleepOrder] = []
    for name in sorted(intents):
        if name in admitted_set:
            continue
        intent, fact = intents[name], facts[name]
        if may_hold_memory(fact):
            if fact.phase not in _TRANSITIONS:  # a transition in progress is awaited, not raced
                sleeps.append(SleepOrder(name, intent.sleep_level, releases_memory=True))
        elif (
            fact.phase is WorkerPhase.ASLEEP
            and fact.level is not None
            and fact.level < intent.sleep_level
        ):
            sleeps.append(SleepOrder(name, intent.sleep_level, releases_memory=False))

    # Blockers that hold for every wake in the group.
    common: list[Blocker] = []
    if handover is not None:
        for other in sorted(handover.outstanding):
            common.append(
                Blocker(
                    BlockReason.AWAITING_ACK,
                    f"no ok sleep ACK from {other} for hand-over {handover.id}",
                    other,
                )
            )
    for name in sorted(intents):
        fact = facts[name]
        if name in admitted_set or not may_hold_memory(fact):
            continue
        if fact.phase is WorkerPhase.UNREACHABLE:
            msg = f"{name} does not answer and may hold memory; it is fenced before any wake"
            common.append(Blocker(BlockReason.UNREACHABLE, msg, name))
        else:
            msg = f"{name} is {fact.phase.value} and must sleep first"
            common.append(Blocker(BlockReason.MUST_SLEEP, msg, name))

    wakes: list[str] = []
    free_left = memory.free
    for name in admitted:
        fact = facts[name]
        if (
            fact.phase in (WorkerPhase.ACTIVE, WorkerPhase.UNREACHABLE)
            or fact.phase in _IN_PROGRESS
        ):
            continue  # holds its admitted share already (or is on its way to it)
        if fact.phase is not WorkerPhase.ASLEEP:
            waiting[name].append(
                Blocker(BlockReason.SELF_BUSY, f"own worker is {fact.phase.value}")
            )
            continue
        blockers = [b for b in common if b.stage != name]
        fp = fps[name]
        if not blockers and free_left is not None:
            capacity = memory.capacity if memory.capacity is not None else free_left
            need = capacity if fp is None else min(fp + margin_bytes, capacity)
            if free_left < need:
                blockers.append(
                    Blocker(
                        BlockReason.FREE_TOO_LOW,
                        f"measured free {_fmt(free_left)} < needed {_fmt(need)} "
                        f"(footprint {_fmt(fp)} + margin)",
                    )
                )
        if blockers:
            waiting[name].extend(blockers)
            continue
        wakes.append(name)
        if free_left is not None:
            free_left -= fp if fp is not None else free_left

    return Decision(
        admitted=tuple(admitted),
        sleep=tuple(sleeps),
        wake=tuple(wakes),
        waiting={k: tuple(v) for k, v in waiting.items() if v},
        footprints=fps,
    )
