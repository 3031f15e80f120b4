"""The colocation-group arbiter: who may hold GPU memory, who must sleep first, who waits and why.

Pure logic: no I/O, no kopf, no clock. ``plan`` takes the group's stage intents (from specs), the
facts its workers measured, the latest measured memory of the group's devices and the
bookkeeping of the hand-over in progress, and returns a ``Decision``.

Rules (the operator's promise rests on them):

- Footprint: the largest of ``vram.request``, the peak the worker measured while Active, its
  measured active footprint and the need learned from a wake refused for lack of memory
  (``footprint``), and for a vLLM stage with ``gpuMemoryUtilization`` that share of the
  measured device capacity. Unknown (none of them) means "the whole group": such a stage is admitted
  only first in order and alone, and it is woken only when no other stage of the group may
  hold memory and the free memory is measured; its footprint is learned from that wake.
- Admission: stages that want Active are ordered by priority (higher first), then by when they
  asked (the most recent ask first, so ``kubectl patch`` of ``spec.state`` switches the awake
  stage), then by name. Walking that order, a stage is admitted when its footprint fits the
  capacity left by the stages admitted before it. A stage whose worker FAILED is not admitted
  (it is fenced and comes back asleep). While the capacity is unknown only the first stage is
  admitted.
- Every stage that is not admitted and may hold memory gets a sleep order at its spec's level,
  except while its worker is Loading, Sleeping or Waking: that transition is awaited first.
  A FAILED worker, an asleep worker whose last sleep ACK the device contradicted, and a stage
  with a pending fence get a fence order instead (admitted or not).
- ``may_hold_memory``: a stage holds memory unless its pod is absent (API confirmed), or it is a
  pod created asleep and not reached yet (charged its CUDA context instead), or its worker
  reported Asleep -- and never while a fence of it is pending or its sleep ACK was contradicted.
  An unreachable or FAILED worker holds memory until fenced (pod deleted, deletion confirmed).
- Wake gate (fails closed): a wake of an admitted, measured-asleep stage is allowed only when
  every stage that had to sleep or be fenced in this hand-over has an ok ACK or a confirmed
  fence, no stage outside the admitted set may hold memory (both per device: such a stage
  blocks only wakes onto the devices its worker reports, ``device_scope``), no pod was started
  in this round, every worker sees the claim's devices, the free memory is measured, and on
  every device the free memory, less a context (``context_bytes``) for each starting pod,
  covers the footprint per device plus a margin. Wakes in one decision are charged one after
  the other.
- Component sleep (a diffusion pipeline's encoders, say): an admitted Active stage whose worker
  reports components asleep other than ``StageIntent.asleep_components`` gets a sleep order
  naming the missing ones (``SleepOrder.components``: it releases memory, so every wake in the
  hand-over waits for its ok ACK; the stage's footprint is what its worker reports, so another
  stage is admitted only once that ACK has shrunk it), or a wake of its components
  (``Decision.component_wakes``) when some asleep component is no longer wanted. Such a wake
  grows the footprint by those components' weights: it must fit the room the admitted stages
  leave and pass the wake gate, it never sends another stage to sleep, and while it does not
  fit the stage waits (``Decision.components_waiting``). Names the worker does not report are
  not ordered (``UnknownComponents``).
- Stages that cannot start asleep (``StageIntent.starts_active``: vLLM takes its memory while
  its engine starts) get no pod until they are admitted and pass the same gate as a wake (their
  footprint, or the whole device when it is unknown); then the decision starts them
  (``Decision.start``) Active. With no other stage of the group on the device (all absent), the
  free memory need not be measured: the worker refuses to start an engine the device's free
  memory does not cover (and so does vLLM). While such a stage is starting or loading, no other
  stage of the group is woken or started (its memory is not measured yet).
- Stages with ``gpus: 0`` in a group whose workers report GPUs hold host RAM only: they are
  admitted without charge and neither gate nor are gated by the GPU's memory.
- Per device: a stage holds, on each of ITS devices (the ones its worker reports; unknown:
  every device of the group, a safe overcharge), what its worker's per-device figures say
  (``footprints.device_need``: the per-device peak kept across wakes, what it holds there now,
  or, never measured, the bytes its device map places there; total figures spread in
  proportion; ``footprint / N`` only when nothing per device is known). Admission and the wake
  gate check each of those devices and charge only them: 1-GPU stages on different devices
  never charge each other, and a 2-GPU stage split unevenly fits only where each side does.
- Every refusal says why with the figures: a wake refused for lack of free memory names the
  device, its measured free memory, the need there and who holds the rest (``Blocker.holders``:
  the group's stages, and ``footprints.OTHER_TENANTS`` for the device's used memory the group's
  workers do not report).
- A stage that needs more GPUs than the group's claim holds (the claim is sized for the largest
  stage when the group starts, and is never resized under running pods) is not admitted:
  ``ClaimTooSmall``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from omnistage_operator.blockers import Blocker, BlockReason
from omnistage_operator.device_scope import blockers_for
from omnistage_operator.footprints import (
    DeviceNeed,
    device_holders,
    device_need,
    device_used,
)
from omnistage_operator.quantities import format_bytes
from omnistage_operator.wakegate import WakeGate

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
    "admission_order",
    "claim_too_small",
    "context_charge",
    "device_mismatches",
    "footprint",
    "group_holders",
    "may_hold_memory",
    "plan",
    "stage_devices",
    "usable_memory",
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
_ENGINE_STARTING = frozenset({WorkerPhase.STARTING, WorkerPhase.LOADING})


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
    # Its worker cannot start asleep (vLLM: the engine takes its memory while it starts): its
    # pod is created Active, only once admitted and the gate passes (``Decision.start``).
    starts_active: bool = False
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
    start: tuple[str, ...] = ()  # absent ``starts_active`` stages whose pods start Active now

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
    """Whether a stage's worker may hold device memory, as far as measured facts tell.

    Absent (deletion confirmed) never holds; a pending fence or a contradicted sleep ACK
    always holds; a starting pod and a measured-asleep worker hold only their context (charged
    by ``context_charge``); everything else (Failed and Unreachable included) holds.
    """
    if facts.phase is WorkerPhase.ABSENT:
        return False
    if facts.fence_pending or facts.ack_contradicted:
        return True
    return facts.phase not in (WorkerPhase.STARTING, WorkerPhase.ASLEEP)


def footprint(intent: StageIntent, facts: StageFacts) -> int | None:
    """The largest of ``vram.request``, the measured peak and active footprint and the learned
    need (a sum over the stage's devices); None when none is known (the stage needs the group).

    A stage not Active whose worker was measured Active and reports components also counts all
    its components' weights plus its context: a wake makes every component resident, while its
    measured footprint may be that of a partial sleep."""
    whole = None
    if facts.phase is not WorkerPhase.ACTIVE and facts.components and facts.active_footprint:
        whole = sum(c.weights_bytes for c in facts.components) + (facts.context_bytes or 0)
    known = [
        n
        for n in (
            intent.vram_request,
            facts.peak_active,
            facts.active_footprint,
            facts.learned_need,
            whole,
        )
        if n is not None and n > 0
    ]
    return max(known) if known else None


def usable_memory(
    intents: Mapping[str, StageIntent], facts: Mapping[str, StageFacts], memory: GroupMemory
) -> int | None:
    """Per device, what the group's stages could hold if only they used the device: the measured
    free memory plus what its reached workers hold beyond their contexts (per device). The
    driver's reserve, every process's context and other processes' memory are not usable.

    None when it cannot be measured: free unknown, or a worker of the group is unreachable (its
    memory is unknown); admission then uses the capacity. Footprints compared with it include
    the stage's own context (measured figures do), a deliberate margin of one context.
    """
    if memory.free is None:
        return None
    charge = context_charge(facts, memory.gpu)
    usable = memory.free
    for name, fact in facts.items():
        intent = intents.get(name)
        if intent is not None and memory.gpu and intent.gpus == 0:
            continue
        if fact.phase is WorkerPhase.UNREACHABLE:
            return None
        if fact.phase in (WorkerPhase.ABSENT, WorkerPhase.STARTING):
            continue
        gpus = max(1, intent.gpus if intent is not None else 1)
        context = fact.context_bytes or charge
        usable += max(0, fact.used_bytes - context) // gpus
    return usable


def context_charge(facts: Mapping[str, StageFacts], gpu: bool = True) -> int:
    """The context charged per starting pod: the largest a worker of the group measured, else
    ``DEFAULT_CONTEXT_BYTES`` on GPUs (0 on a host-accounting device: no CUDA context)."""
    measured = [f.context_bytes for f in facts.values() if f.context_bytes]
    if measured:
        return max(measured)
    return DEFAULT_CONTEXT_BYTES if gpu else 0


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


def admission_order(intents: Mapping[str, StageIntent]) -> list[str]:
    """Stages that want Active: priority desc, then most recent ask first, then name."""
    wanting = [i for i in intents.values() if i.want_active]
    wanting.sort(key=lambda i: (-i.priority, -i.requested_active_at, i.name))
    return [i.name for i in wanting]


def _fmt(n: int | None) -> str:
    return "unknown" if n is None else format_bytes(n)


def stage_devices(fact: StageFacts, memory: GroupMemory) -> tuple[str, ...]:
    """The devices a stage holds memory on: those its worker reports (of the group's), else
    every device of the group (a safe overcharge); ``("",)`` for a host-accounting group."""
    if not memory.devices:
        return ("",)
    known = [d.uuid for d in memory.devices]
    mine = tuple(u for u in known if u in fact.device_uuids)
    return mine or tuple(known)


def _usable_by_device(
    intents: Mapping[str, StageIntent], facts: Mapping[str, StageFacts], memory: GroupMemory
) -> dict[str, int] | None:
    """Per device, :func:`usable_memory`: its free memory plus what the group's reached
    workers hold on it beyond their contexts, from their per-device reports (None when it
    cannot be measured)."""
    if usable_memory(intents, facts, memory) is None:
        return None
    if not memory.devices:
        assert memory.free is not None
        usable = {"": memory.free}
    else:
        usable = {d.uuid: d.free for d in memory.devices}
    charge = context_charge(facts, memory.gpu)
    for name, fact in facts.items():
        intent = intents.get(name)
        if intent is not None and memory.gpu and intent.gpus == 0:
            continue
        if fact.phase in (WorkerPhase.ABSENT, WorkerPhase.STARTING):
            continue
        devices = stage_devices(fact, memory)
        gpus = max(1, intent.gpus if intent is not None else 1)
        context = (fact.context_bytes or charge) // gpus
        for device, used in device_used(fact, devices, gpus).items():
            usable[device] += max(0, used - context)
    return usable


def group_holders(
    intents: Mapping[str, StageIntent], facts: Mapping[str, StageFacts], memory: GroupMemory
) -> dict[str, tuple[tuple[str, int], ...]]:
    """Per device, who holds its memory now (``footprints.device_holders``): the group's
    reached stages by name, and the rest of the device's used memory as other tenants."""
    out: dict[str, tuple[tuple[str, int], ...]] = {}
    if memory.free is None:
        return out
    rows = (
        [(d.uuid, d.total, d.free) for d in memory.devices]
        if memory.devices
        else [("", memory.capacity or memory.free, memory.free)]
    )
    per_device: dict[str, dict[str, int]] = {uuid: {} for uuid, _, _ in rows}
    for name, fact in sorted(facts.items()):
        intent = intents.get(name)
        if fact.phase is WorkerPhase.ABSENT or (
            intent is not None and memory.gpu and intent.gpus == 0
        ):
            continue
        gpus = max(1, intent.gpus if intent is not None else 1)
        for device, used in device_used(fact, stage_devices(fact, memory), gpus).items():
            if device in per_device:
                per_device[device][name] = used
    for uuid, total, free in rows:
        out[uuid] = device_holders(uuid, total, free, per_device[uuid])
    return out


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


def _with_share(fp: int | None, intent: StageIntent, memory: GroupMemory) -> int | None:
    """A footprint at least the engine's share of the measured device capacity (summed over the
    stage's devices), for a stage that sets one (vLLM's gpuMemoryUtilization)."""
    if intent.memory_share is None or memory.capacity is None:
        return fp
    share = int(intent.memory_share * memory.capacity) * max(1, intent.gpus)
    return max(fp or 0, share)


def _needs(
    intents: Mapping[str, StageIntent],
    facts: Mapping[str, StageFacts],
    memory: GroupMemory,
    fps: Mapping[str, int | None],
) -> dict[str, DeviceNeed | None]:
    """Every stage's need per device (``footprints.device_need``; None: unknown)."""
    return {
        name: device_need(
            intents[name], facts[name], memory, stage_devices(facts[name], memory), fps[name]
        )
        for name in intents
    }


def _largest(need: DeviceNeed | None) -> int | None:
    """A need's largest per-device figure (None: unknown)."""
    return None if need is None else max(need.values(), default=0)


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


def plan(
    intents: Mapping[str, StageIntent],
    facts: Mapping[str, StageFacts],
    memory: GroupMemory,
    handover: Handover | None = None,
    *,
    margin_bytes: int = 0,
    started: frozenset[str] = frozenset(),
) -> Decision:
    """Decide sleeps, fences, wakes and waits for one group (see the module docstring).

    ``started``: the stages whose pods this round created (no wake in that round).
    """
    absent = StageFacts(WorkerPhase.ABSENT)
    facts = {name: facts.get(name, absent) for name in intents}
    off_device = frozenset(n for n in intents if memory.gpu and intents[n].gpus == 0)
    fps = {name: _with_share(footprint(intents[name], facts[name]), intents[name], memory)
           for name in intents}  # fmt: skip
    needs = _needs(intents, facts, memory, fps)
    waiting: dict[str, list[Blocker]] = {name: [] for name in intents}
    admitted = _admit(intents, facts, memory, needs, off_device, waiting)
    for name, intent in intents.items():  # not loaded yet (no pod: none is started) too
        too_small = claim_too_small(intent, memory)
        if too_small is not None and too_small not in waiting[name]:
            waiting[name].append(too_small)
    sleeps, fences = _sleeps_and_fences(intents, facts, frozenset(admitted), off_device)
    common = _common_blockers(
        intents,
        facts,
        memory,
        handover=handover,
        started=started,
        fences=fences,
        admitted=frozenset(admitted),
        off_device=off_device,
    )
    starting = [
        n for n in intents if n not in off_device and facts[n].phase is WorkerPhase.STARTING
    ]
    gate = WakeGate(memory, margin_bytes, context_charge(facts, memory.gpu), starting)
    gate.holders = group_holders(intents, facts, memory)
    parts = _components(intents, facts, memory, needs, admitted, off_device)
    sleeps.extend(parts.sleeps)
    component_wakes: list[str] = []
    for name, growth in parts.wakes.items():
        on = stage_devices(facts[name], memory)
        grows = dict.fromkeys(on, -(-growth // max(1, len(on))))
        blockers = blockers_for(common, name, on, facts, memory) or gate.blockers(name, grows, on)
        if blockers:
            parts.waiting.setdefault(name, []).extend(blockers)
            continue
        component_wakes.append(name)
        gate.take(grows, on)
    wakes: list[str] = []
    starts: list[str] = []
    for name in admitted:
        fact = facts[name]
        if (
            fact.phase in (WorkerPhase.ACTIVE, WorkerPhase.UNREACHABLE)
            or fact.phase in _IN_PROGRESS
        ):
            continue  # holds its admitted share already (or is on its way to it)
        start = intents[name].starts_active and fact.phase is WorkerPhase.ABSENT
        if fact.phase is not WorkerPhase.ASLEEP and not start:
            waiting[name].append(
                Blocker(BlockReason.SELF_BUSY, f"own worker is {fact.phase.value}")
            )
            continue
        if name in off_device:
            wakes.append(name)  # host RAM only: the GPU gate does not apply
            continue
        devices = stage_devices(fact, memory)
        blockers = blockers_for(common, name, devices, facts, memory)
        alone = start and all(facts[n].phase is WorkerPhase.ABSENT for n in intents if n != name)
        if not blockers and not (alone and gate.free_left is None):
            # (alone: nothing of the group on the device; the engine's own start check gates)
            blockers = gate.blockers(name, needs[name], devices)
        if blockers:
            waiting[name].extend(blockers)
            continue
        (starts if start else wakes).append(name)
        gate.take(needs[name], devices)
    return Decision(
        admitted=tuple(admitted),
        sleep=tuple(sleeps),
        wake=tuple(wakes),
        waiting={k: tuple(v) for k, v in waiting.items() if v},
        footprints=fps,
        fence=tuple(fences),
        component_wakes=tuple(component_wakes),
        components_waiting={k: tuple(v) for k, v in parts.waiting.items() if v},
        start=tuple(starts),
    )


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
    for name in sorted(intents):
        engine_starting = facts[name].phase in _ENGINE_STARTING and name not in started
        if intents[name].starts_active and engine_starting:
            msg = f"{name} is starting its engine Active; its memory is not measured yet"
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
