"""A group's device memory from its workers' reports (pure: no I/O, no clock).

``group_memory`` is the one place the operator turns GetStatus answers into the arbiter's
``GroupMemory``:

- Only GPUs count: a device with a UUID (NVML's, or a simulated GPU's). A ``gpus: 0`` worker's
  host RAM (accounting figures, no UUID) never enters a GPU group's capacity or free memory.
- Per device: the capacity is the largest total any worker reported for that UUID, the free
  memory the smallest free figure (readings taken a moment apart: the lower one is safe). The
  group's scalars are the tightest device's.
- A group whose workers report no UUID (CPU workers on an accounting device standing in for a
  GPU, as in CI) uses the accounting figures of its GPU stages' workers (``gpus`` > 0) as one
  device, as before; a ``gpus: 0`` stage's figures are never used in a group with GPU stages.
- ``claim_uuids``: the devices the group's claim allocated (DRA), checked by the arbiter against
  every worker's (``arbiter.gate.device_mismatches``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from omnistage_operator.decisions.arbiter import DeviceMemory, GroupMemory
from omnistage_operator.decisions.facts import WorkerReport

__all__ = ["group_memory"]


def group_memory(
    reports: Mapping[str, WorkerReport],
    gpus: Mapping[str, int] | None = None,
    claim_uuids: Sequence[str] | None = None,
) -> GroupMemory:
    """The group's memory from its reachable workers' reports, by stage name (see the module
    docstring). ``gpus``: every stage's ``spec.gpus`` (a stage absent from it counts as a GPU
    stage); a group whose stages all have ``gpus: 0`` is arbitrated on host accounting."""
    gpus = gpus or {}
    if not gpus or any(n > 0 for n in gpus.values()):
        reports = {n: r for n, r in reports.items() if gpus.get(n, 1) > 0}
    claim = tuple(sorted(claim_uuids)) if claim_uuids is not None else None
    totals: dict[str, int] = {}
    frees: dict[str, int] = {}
    for rep in reports.values():
        for d in rep.devices:
            if not d.uuid or d.total <= 0:
                continue
            totals[d.uuid] = max(totals.get(d.uuid, 0), d.total)
            frees[d.uuid] = min(frees.get(d.uuid, d.free_after), d.free_after)
    if totals:
        devices = tuple(DeviceMemory(u, totals[u], frees[u]) for u in sorted(totals))
        return GroupMemory(
            capacity=min(d.total for d in devices),
            free=min(d.free for d in devices),
            devices=devices,
            claim_uuids=claim,
        )
    measured = [r for r in reports.values() if r.total_bytes > 0]
    if not measured:
        return GroupMemory(claim_uuids=claim)
    return GroupMemory(
        capacity=max(r.total_bytes for r in measured),
        free=min(r.free_bytes for r in measured),
        claim_uuids=claim,
    )
