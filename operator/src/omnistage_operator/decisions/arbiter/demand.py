"""What a stage holds and needs: footprints, usable memory and holders per device (pure)."""

from __future__ import annotations

from collections.abc import Mapping

from omnistage_operator.decisions.arbiter import (
    DEFAULT_CONTEXT_BYTES,
    GroupMemory,
    StageFacts,
    StageIntent,
    WorkerPhase,
)
from omnistage_operator.decisions.arbiter.footprints import (
    DeviceNeed,
    device_holders,
    device_need,
    device_used,
)
from omnistage_worker.quantities import format_bytes


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
