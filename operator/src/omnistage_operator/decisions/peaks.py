"""Per-device peaks of a stage, kept across wakes, pods and operator restarts (pure logic).

A worker reports the most it held while Active since its last wake (``peak_active_bytes``, a
sum) and what it holds per device now; a wake resets its own figure toward the weights alone.
Admission must charge what the stage takes under load (activations, KV caches, allocator pools),
so the operator keeps, per device UUID:

- ``kept``: the most the stage was measured holding while Active, ever (until its pod is
  replaced for a spec change): every Active GetStatus, every sleep ACK's "before" figures
  (taken while Active, before the cached blocks went back), the worker's own summed peak
  spread over its devices by their current share. Persisted in ``status.memory.peak`` so a new
  pod of the stage and a restarted operator start from it.
- ``since_wake``: the most it was seen holding per device since its last wake (reset by a wake
  or a component sleep ACK): what an ok sleep ACK must show leaving the device, even when the
  worker's own figures no longer see it (``facts.ack_contradiction``). Not persisted.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from omnistage_operator.decisions.facts import AckFacts, WorkerReport

__all__ = ["StagePeaks", "from_status", "to_status"]


def _merge(into: Mapping[str, int], more: Mapping[str, int]) -> dict[str, int]:
    out = dict(into)
    for k, v in more.items():
        if k and v > out.get(k, 0):
            out[k] = v
    return out


def _spread(total: int, used: Mapping[str, int]) -> dict[str, int]:
    """A summed figure spread over devices by their share of ``used`` (one device: all)."""
    keys = [k for k in used if k]
    if not keys or total <= 0:
        return {}
    if len(keys) == 1:
        return {keys[0]: total}
    weight = sum(max(0, used[k]) for k in keys)
    if weight <= 0:
        return {}
    return {k: total * max(0, used[k]) // weight for k in keys}


@dataclass(frozen=True)
class StagePeaks:
    """One stage's per-device peaks (bytes by device UUID); see the module docstring."""

    kept: Mapping[str, int] = field(default_factory=dict)
    since_wake: Mapping[str, int] = field(default_factory=dict)
    pod_uid: str = ""  # the pod ``since_wake`` was seen on

    def seen(self, report: WorkerReport, pod_uid: str = "") -> StagePeaks:
        """Count a GetStatus answer of the worker in pod ``pod_uid``: per-device figures of an
        Active worker, and its peak (a new pod starts ``since_wake`` anew)."""
        base = self if pod_uid == self.pod_uid else replace(self, since_wake={}, pod_uid=pod_uid)
        if str(report.phase) != "Active":
            return base
        now = {d.uuid: d.used_after for d in report.devices if d.uuid}
        peak = _spread(report.peak_active_bytes, now)
        return replace(
            base,
            kept=_merge(_merge(base.kept, now), peak),
            since_wake=_merge(base.since_wake, now),
        )

    def acked(self, ack: AckFacts) -> StagePeaks:
        """Count an ACK: a sleep's "before" figures were taken while Active; a wake (or a
        component sleep, after which the worker stays Active with less) starts ``since_wake``
        anew from its "after" figures. A component sleep also sets ``kept`` to what stays
        resident (the arbiter admits another stage into the room it made)."""
        before = {d.uuid: d.used_before for d in ack.devices if d.uuid}
        after = {d.uuid: d.used_after for d in ack.devices if d.uuid}
        kept = self.kept
        if ack.op == "sleep" and not ack.noop:
            kept = _merge(_merge(kept, before), _spread(ack.peak_active_bytes, before))
        parts = ack.ok and ack.op == "sleep" and str(ack.state) == "Active"
        restart = ack.ok and (ack.op == "wake" or parts)
        since = dict(after) if restart else dict(self.since_wake)
        if parts:
            kept = dict(after)  # components asleep: the footprint is what stays resident
        elif ack.op == "wake" and ack.ok:
            kept = _merge(kept, after)
        return StagePeaks(kept=kept, since_wake=since, pod_uid=self.pod_uid)


def to_status(peaks: StagePeaks | None) -> dict[str, int] | None:
    """``status.memory.peak``: bytes by device UUID (None when nothing was measured)."""
    if peaks is None or not peaks.kept:
        return None
    return dict(sorted(peaks.kept.items()))


def from_status(status: Mapping[str, Any] | None) -> StagePeaks | None:
    """Read back ``status.memory.peak`` (None when absent or malformed)."""
    memory = (status or {}).get("memory") or {}
    peak = memory.get("peak") if isinstance(memory, Mapping) else None
    if not isinstance(peak, Mapping):
        return None
    kept = {str(k): int(v) for k, v in peak.items() if isinstance(v, int) and v > 0}
    return StagePeaks(kept=kept) if kept else None
