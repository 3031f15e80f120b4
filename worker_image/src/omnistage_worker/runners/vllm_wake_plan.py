"""What a vLLM sleep or wake moves, in which order, and into which kept host buffer (pure).

vLLM's ``CuMemAllocator`` (0.24) keeps one record per device allocation: its handle
``(device, size, ptr, memory handle)`` and its tag ("weights", "kv_cache"). Its own sleep copies
each offloaded allocation into a fresh pinned tensor with a blocking ``cudaMemcpy``; its wake maps
each allocation and copies it back, one after the other. The fast path
(:mod:`.vllm_wake`) keeps the same semantics and changes only the order and the buffers:

- which allocations: a sleep backs up those whose tag is offloaded (vLLM's default tag when
  none is given; a string is one tag) and releases every allocation; a wake maps those whose tag
  is woken (all when ``tags`` is None) and copies back the ones with a backup;
- where: one host buffer holds every backup at an aligned offset (:func:`plan_sleep`); it is
  allocated at the first sleep that offloads and kept across cycles (:func:`reuse_buffer`); a
  sleep that offloads nothing (vLLM's level 2) gives it back;
- in which order (:func:`sleep_steps`, :func:`wake_steps`): a sleep issues every copy at once,
  releases what it discards while they run, waits once, then releases what it copied; a wake maps
  each backed-up allocation and issues its copy right away, maps the rest (the KV cache) while
  the copies run, and waits once (the ``overlap`` order; :data:`WAKE_ORDERS` has the others).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from omnistage_worker.engine.layout import align_up

DEFAULT_TAG = "default"
"""``CuMemAllocator.default_tag``: what vLLM offloads when a sleep names no tags."""

ALIGN = 4096
"""Offsets of the backups in the host buffer (vLLM's allocations are 2 MiB multiples anyway)."""


@dataclass(frozen=True)
class Allocation:
    """One record of vLLM's allocator: the device pointer, its (aligned) size and its tag."""

    ptr: int
    size: int
    tag: str


@dataclass(frozen=True)
class Backup:
    """Where one allocation's bytes are kept while asleep: ``offset`` into the host buffer."""

    ptr: int
    size: int
    offset: int


@dataclass(frozen=True)
class SleepPlan:
    """The backups (in the allocator's order) and the allocations released without a copy."""

    backups: tuple[Backup, ...]
    discard: tuple[int, ...]
    total_bytes: int

    @property
    def backup_bytes(self) -> int:
        return sum(b.size for b in self.backups)

    @property
    def buffer_bytes(self) -> int:
        """The host buffer this plan needs (the end of its last backup)."""
        return max((b.offset + b.size for b in self.backups), default=0)


@dataclass(frozen=True)
class WakePlan:
    """Allocations to map and fill from their backup, then those only to map."""

    copies: tuple[Backup, ...]
    maps_only: tuple[int, ...]

    @property
    def copy_bytes(self) -> int:
        return sum(b.size for b in self.copies)


def offload_tags_of(offload_tags: tuple[str, ...] | str | None) -> tuple[str, ...]:
    """vLLM's reading of ``sleep(offload_tags)``: None is the default tag, a string one tag."""
    if offload_tags is None:
        return (DEFAULT_TAG,)
    if isinstance(offload_tags, str):
        return (offload_tags,)
    return tuple(offload_tags)


def plan_sleep(
    allocations: Iterable[Allocation], offload_tags: tuple[str, ...] | str | None
) -> SleepPlan:
    """Back up the allocations with an offloaded tag, one after the other in the host buffer."""
    tags = offload_tags_of(offload_tags)
    backups: list[Backup] = []
    discard: list[int] = []
    offset = total = 0
    for a in allocations:
        total += a.size
        if a.tag in tags:
            backups.append(Backup(a.ptr, a.size, offset))
            offset = align_up(offset + a.size, ALIGN)
        else:
            discard.append(a.ptr)
    return SleepPlan(tuple(backups), tuple(discard), total)


def plan_wake(
    allocations: Iterable[Allocation], tags: list[str] | None, backups: Mapping[int, Backup]
) -> WakePlan:
    """The allocations a ``wake_up(tags)`` maps: with a backup of the same size, filled from it."""
    copies: list[Backup] = []
    maps_only: list[int] = []
    for a in allocations:
        if tags is not None and a.tag not in tags:
            continue
        kept = backups.get(a.ptr)
        if kept is not None and kept.size == a.size:
            copies.append(kept)
        else:
            maps_only.append(a.ptr)
    return WakePlan(tuple(copies), tuple(maps_only))


def reuse_buffer(capacity: int | None, needed: int) -> bool:
    """Whether the kept host buffer (``capacity`` bytes, None: none kept) serves a sleep that
    needs ``needed`` bytes; otherwise it is given back and, if ``needed``, one of that size
    is allocated."""
    return capacity is not None and needed > 0 and capacity >= needed


@dataclass(frozen=True)
class Step:
    """One step of a transition: ``op`` in "sync_device", "copy_d2h", "copy_h2d", "map",
    "release", "sync_copies"; ``ptr`` and ``backup`` where they apply."""

    op: str
    ptr: int = 0
    backup: Backup | None = None


def sleep_steps(plan: SleepPlan) -> list[Step]:
    """Wait for the device's work, issue all copies, release the discarded allocations while
    they run, wait once for the copies, release the copied allocations."""
    steps = [Step("sync_device")]
    steps += [Step("copy_d2h", b.ptr, b) for b in plan.backups]
    steps += [Step("release", ptr) for ptr in plan.discard]
    if plan.backups:
        steps.append(Step("sync_copies"))
    steps += [Step("release", b.ptr) for b in plan.backups]
    return steps


WAKE_ORDERS = ("overlap", "map_first", "kv_after")
"""How a wake orders its maps and copies: ``overlap`` maps each backed-up allocation and issues
its copy at once, then maps the rest (the KV cache) while the copies run; ``map_first`` maps
everything, then issues the copies; ``kv_after`` maps and copies the backed-up allocations,
waits for the copies, then maps the rest. The driver cleans memory that is mapped anew and may
share the copy engine with the copies (bench/results/vllm_stage.md), so which is fastest is
the driver's to say."""


def checked_order(order: str) -> str:
    """``order`` if it is one of :data:`WAKE_ORDERS`; ValueError naming them otherwise."""
    if order not in WAKE_ORDERS:
        raise ValueError(f"wake order {order!r} is none of {', '.join(WAKE_ORDERS)}")
    return order


def wake_steps(plan: WakePlan, order: str = "overlap") -> list[Step]:
    """The wake's steps in ``order`` (:data:`WAKE_ORDERS`), one wait for the copies in each."""
    checked_order(order)
    restore = [s for b in plan.copies for s in (Step("map", b.ptr), Step("copy_h2d", b.ptr, b))]
    rest = [Step("map", ptr) for ptr in plan.maps_only]
    wait = [Step("sync_copies")] if plan.copies else []
    if order == "map_first":
        maps = [Step("map", b.ptr) for b in plan.copies]
        copies = [Step("copy_h2d", b.ptr, b) for b in plan.copies]
        return maps + rest + copies + wait
    if order == "kv_after":
        return restore + wait + rest
    return restore + rest + wait


@dataclass
class Phases:
    """Seconds per phase of one transition, with the bytes copied and allocations touched."""

    kind: str
    seconds: dict[str, float] = field(default_factory=dict)
    copy_bytes: int = 0
    copies: int = 0
    maps: int = 0
    releases: int = 0

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    def as_json(self) -> dict[str, object]:
        total = self.total
        return {
            "kind": self.kind,
            "seconds": {k: round(v, 6) for k, v in self.seconds.items()},
            "total_seconds": round(total, 6),
            "copy_bytes": self.copy_bytes,
            "copy_gbps": round(self.copy_bytes / total / 1e9, 3) if total > 0 else None,
            "copies": self.copies,
            "maps": self.maps,
            "releases": self.releases,
        }


PHASE_OF_STEP = {
    "sync_device": "sync_device",
    "copy_d2h": "copies_issued",
    "copy_h2d": "copies_issued",
    "sync_copies": "sync",
}
"""The phase a step's time is counted in (maps and releases: see :func:`phase_of`)."""


def phase_of(step: Step, backed: frozenset[int]) -> str:
    """The breakdown's phase of ``step``: maps and releases of backed-up allocations
    ("map_weights", "release_copied") apart from the others ("map_kv", "release_discarded")."""
    if step.op == "map":
        return "map_weights" if step.ptr in backed else "map_kv"
    if step.op == "release":
        return "release_copied" if step.ptr in backed else "release_discarded"
    return PHASE_OF_STEP[step.op]
