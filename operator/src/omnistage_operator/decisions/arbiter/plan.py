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
- A vLLM stage starts asleep like any other (pre-warmed at level 2: vLLM imported, no engine,
  nothing on the device); its first wake starts its engine, so it is charged what the engine
  will take (``StageIntent.memory_share`` of each device's capacity, or its ``vram_request``)
  before it ever ran, and that wake passes the same gate as any other.
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

from omnistage_operator.decisions.arbiter import (
    _IN_PROGRESS,
    Blocker,
    BlockReason,
    Decision,
    GroupMemory,
    Handover,
    StageFacts,
    StageIntent,
    WorkerPhase,
)
from omnistage_operator.decisions.arbiter.admission import _admit, claim_too_small
from omnistage_operator.decisions.arbiter.components import _components
from omnistage_operator.decisions.arbiter.demand import (
    _needs,
    _with_share,
    context_charge,
    footprint,
    group_holders,
    stage_devices,
)
from omnistage_operator.decisions.arbiter.device_scope import blockers_for
from omnistage_operator.decisions.arbiter.gate import _common_blockers
from omnistage_operator.decisions.arbiter.sleeps import _sleeps_and_fences
from omnistage_operator.decisions.arbiter.wakegate import WakeGate


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
        if name in off_device:
            wakes.append(name)  # host RAM only: the GPU gate does not apply
            continue
        devices = stage_devices(fact, memory)
        blockers = blockers_for(common, name, devices, facts, memory)
        if not blockers:
            blockers = gate.blockers(name, needs[name], devices)
        if blockers:
            waiting[name].extend(blockers)
            continue
        wakes.append(name)
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
    )
