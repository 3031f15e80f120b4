"""The colocation-group arbiter: who may hold GPU memory, who must sleep first, who waits and why.

Pure logic: no I/O, no kopf, no clock. This package holds the arbiter's vocabulary (the stage
intents and facts, the group's memory, the orders and the ``Decision``); ``plan`` (its rules in
:mod:`.plan`'s docstring) decides with the parts by concern:

- :mod:`.demand`: what a stage holds and needs (footprints, usable memory, holders per device);
- :mod:`.admission`: the admission order and who is admitted;
- :mod:`.sleeps`: sleep orders and fence orders (sleep choice, fencing);
- :mod:`.components`: component sleeps and wakes of admitted Active stages;
- :mod:`.gate`: the blockers common to every wake of the group (the wake gate's inputs);
- :mod:`.plan`: ``plan``, which runs them and the wake gate in turn.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from omnistage_operator.decisions.arbiter.blockers import Blocker, BlockReason

__all__ = [
    "DEFAULT_CONTEXT_BYTES",
    "BlockReason",
    "Blocker",
    "ComponentFacts",
    "Decision",
    "DeviceMemory",
    "FenceOrder",
    "GroupMemory",
    "Handover",
    "SleepOrder",
    "StageFacts",
    "StageIntent",
    "WorkerPhase",
]

# The CUDA context of one process as NVML sees it on an H100 (bench LIMITS.md, 2026-11-21):
# charged for every pod that is starting while no worker of the group has measured its own.
DEFAULT_CONTEXT_BYTES = 612 << 20


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
    FAILED = "Failed"  # holds memory until fenced (a failed residual check never reads Asleep)


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
    gpus: int = 1  # 0: a CPU stage (host RAM only)
    drain_timeout_s: float | None = None  # spec's drain timeout; None: the worker's own
    asleep_components: frozenset[str] = frozenset()  # kept asleep while Active
    # vLLM's gpuMemoryUtilization: the share of each device's total its engine takes (a floor
    # for its footprint once the capacity is measured).
    memory_share: float | None = None


@dataclass(frozen=True)
class ComponentFacts:
    """One pipeline component as its worker reports it (``level`` None: resident)."""

    name: str
    weights_bytes: int = 0
    device_bytes: int = 0
    level: int | None = None

    @property
    def asleep(self) -> bool:
        """The component's weights are off the device."""
        return self.level is not None


@dataclass(frozen=True)
class StageFacts:
    """What the stage's worker measured, plus what the operator persisted about it."""

    phase: WorkerPhase
    level: int | None = None  # sleep level while asleep
    used_bytes: int = 0
    active_footprint: int | None = None  # measured after the worker's last wake or load
    peak_active: int | None = None  # most held while Active since the last wake (GetStatus)
    learned_need: int | None = None  # from a wake refused for lack of memory (persisted)
    context_bytes: int | None = None  # the worker's CUDA context, measured at its start
    fence_pending: bool = False  # a fence was started and not confirmed (persisted in status)
    ack_contradicted: str | None = None  # why its last ok sleep ACK is not trusted
    inflight_requests: int = 0
    device_uuids: tuple[str, ...] = ()  # GPU devices the worker sees (empty: none or CPU)
    components: tuple[ComponentFacts, ...] = ()  # per pipeline component (empty: undivided)
    # Per device UUID: what the worker holds there now, its peak while Active kept across wakes
    # (persisted in status.memory.peak), and the weights its loader's device map places there.
    device_used: Mapping[str, int] = field(default_factory=dict)
    device_peaks: Mapping[str, int] = field(default_factory=dict)
    device_weights: Mapping[str, int] = field(default_factory=dict)
    # Per device, the most the worker was seen holding since its last wake (not persisted): an
    # ok sleep ACK of it must show that leaving the device (``facts.ack_contradiction``).
    device_held: Mapping[str, int] = field(default_factory=dict)
    # The worker streams its sleep and wakes under a claim limit (an overlapped hand-over);
    # false for one that cannot or is older than those RPCs.
    claim_limits: bool = False
    # The worker hands its device pieces over, and takes them, on a hand-off channel (it has a
    # hand-off directory: GetStatus.handoff).
    handoff: bool = False

    @property
    def asleep_components(self) -> frozenset[str]:
        """The components whose weights are off the device."""
        return frozenset(c.name for c in self.components if c.asleep)


@dataclass(frozen=True)
class DeviceMemory:
    """One GPU's latest measured capacity and free memory (all processes)."""

    uuid: str
    total: int
    free: int


@dataclass(frozen=True)
class GroupMemory:
    """The group's device memory (``memory.group_memory`` builds it from worker reports).

    ``capacity`` and ``free`` are per device: the smallest device's figures. ``devices`` lists
    each GPU (empty for a CPU/accounting group: then the scalars are the one device).
    ``claim_uuids``: the devices of the group's claim, when known (checked against workers).
    """

    capacity: int | None = None
    free: int | None = None
    devices: tuple[DeviceMemory, ...] = ()
    claim_uuids: tuple[str, ...] | None = None

    @property
    def gpu(self) -> bool:
        """The figures come from GPUs (device UUIDs), not from host accounting."""
        return bool(self.devices)


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


@dataclass(frozen=True)
class SleepOrder:
    """Put ``stage`` to sleep at ``level``; ``releases_memory`` is False for a 1->2 deepening.

    ``drain_timeout_s``: how long the worker may wait for in-flight requests (None: its own
    bound); ``inflight_requests``: what its GetStatus reported when the order was made.
    """

    stage: str
    level: int
    releases_memory: bool = True
    drain_timeout_s: float | None = None
    inflight_requests: int = 0
    components: tuple[str, ...] = ()  # only these (the worker stays Active); empty: the model
    # What the stage was seen holding per device since its last wake, and its context: its ok
    # ACK must show them leaving the device (``facts.ack_contradiction``); not compared.
    held: Mapping[str, int] = field(default_factory=dict, compare=False)
    context_bytes: int | None = field(default=None, compare=False)


@dataclass(frozen=True)
class FenceOrder:
    """Delete ``stage``'s pod and wait for the API's confirmation before any wake."""

    stage: str
    reason: BlockReason
    message: str


@dataclass(frozen=True)
class Decision:
    """The arbiter's answer for one group."""

    admitted: tuple[str, ...]
    sleep: tuple[SleepOrder, ...]
    wake: tuple[str, ...]
    waiting: Mapping[str, tuple[Blocker, ...]] = field(default_factory=dict)
    footprints: Mapping[str, int | None] = field(default_factory=dict)
    fence: tuple[FenceOrder, ...] = ()
    component_wakes: tuple[str, ...] = ()  # Active stages whose asleep components wake
    components_waiting: Mapping[str, tuple[Blocker, ...]] = field(default_factory=dict)

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
