"""Per-device footprints and holders: what a stage needs on each of its GPUs, and who holds what.

Pure logic used by :mod:`.arbiter` (no I/O, no clock). A stage on several GPUs is rarely split
evenly (a diffusion pipeline is dealt out by whole components), so admission and the wake gate
charge each device what the stage's worker reported for it:

- ``measured``: per device, the most of the per-device peak kept across wakes and persisted in
  status and what the worker holds there now while Active; for a stage never measured, the
  weights its loader's device map places there plus its context's share;
- total figures (``vram.request``, a learned need, the summed peak) are spread over the devices in
  proportion to those per-device figures, or evenly when the stage was never measured and its
  worker does not report its placement (then every device is charged ``total / gpus``);
- vLLM's ``gpuMemoryUtilization`` is a share of each device's own capacity.

``holders`` says who holds a device's memory: the group's stages by name, and everything else
(processes outside the group, the driver's reserve) as :data:`OTHER_TENANTS`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from omnistage_operator.decisions.arbiter import GroupMemory, StageFacts, StageIntent

__all__ = [
    "OTHER_TENANTS",
    "DeviceNeed",
    "device_holders",
    "device_need",
    "device_used",
    "measured_per_device",
]

OTHER_TENANTS = "other tenants"

DeviceNeed = dict[str, int]
"""Bytes a stage needs per device UUID (``""``: the one device of a host-accounting group)."""


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def device_used(fact: StageFacts, devices: Sequence[str], gpus: int) -> dict[str, int]:
    """What the stage's worker holds on each of ``devices`` now: its per-device report, else its
    sum spread evenly (a worker that reports no per-device figure)."""
    if fact.device_used and any(d in fact.device_used for d in devices):
        return {d: fact.device_used.get(d, 0) for d in devices}
    share = fact.used_bytes // max(1, gpus)
    return dict.fromkeys(devices, share)


def measured_per_device(
    fact: StageFacts, devices: Sequence[str], gpus: int
) -> dict[str, int] | None:
    """The stage's own per-device figures on ``devices`` (None when it reports none): the kept
    peak and what it holds now while Active; for a stage never measured, the weights its
    loader's device map places on each device plus its context's share (a stage measured with
    components asleep is charged what it was measured holding, not all its weights)."""
    active = str(fact.phase) == "Active"
    out: dict[str, int] = {}
    for d in devices:
        seen = max(fact.device_peaks.get(d, 0), fact.device_used.get(d, 0) if active else 0)
        if seen:
            out[d] = seen
    if out:
        return out
    context = (fact.context_bytes or 0) // max(1, gpus)
    planned = {d: fact.device_weights[d] + context for d in devices if fact.device_weights.get(d)}
    return planned or None


def device_need(
    intent: StageIntent,
    fact: StageFacts,
    memory: GroupMemory,
    devices: Sequence[str],
    total: int | None,
) -> DeviceNeed | None:
    """What ``intent`` needs on each of ``devices`` (see the module docstring); ``total`` is its
    footprint summed over its devices (``arbiter.demand.footprint``). None: unknown (the whole
    group)."""
    gpus = max(1, intent.gpus)
    measured = measured_per_device(fact, devices, gpus) if memory.devices else None
    need: DeviceNeed | None = None
    if measured:
        weight = sum(measured.values())
        need = {}
        for d in devices:
            own = measured.get(d, 0)
            spread = _ceil_div(total * own, weight) if total and weight else 0
            need[d] = max(own, spread)
    elif total is not None:
        need = dict.fromkeys(devices, _ceil_div(total, gpus))
    if intent.memory_share is not None and memory.capacity is not None:
        totals = {x.uuid: x.total for x in memory.devices}
        need = need or {}
        for d in devices:
            share = int(intent.memory_share * totals.get(d, memory.capacity))
            need[d] = max(need.get(d, 0), share)
    return need


def device_holders(
    uuid: str,
    total: int,
    free: int,
    used_by_stage: Mapping[str, int],
) -> tuple[tuple[str, int], ...]:
    """Who holds device ``uuid``'s memory, most first: the group's stages (``used_by_stage``,
    bytes on this device) and :data:`OTHER_TENANTS` (the device's used memory, ``total - free``,
    less what the group's workers report: other processes and the driver's reserve)."""
    del uuid  # the caller's key; the figures are the device's own
    group = {n: b for n, b in used_by_stage.items() if b > 0}
    others = max(0, total - free - sum(group.values()))
    holders = sorted(group.items(), key=lambda kv: (-kv[1], kv[0]))
    if others > 0:
        holders.append((OTHER_TENANTS, others))
        holders.sort(key=lambda kv: (-kv[1], kv[0]))
    return tuple(holders)
