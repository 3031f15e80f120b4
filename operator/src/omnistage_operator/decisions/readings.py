"""A round's readings after its own ACKs, without asking the workers again (pure: no I/O).

Within one round, the group is read (every worker's GetStatus) before the plan; after the
sleeps the gate needs the group again, and after the wakes the status does. When every worker
the round ordered answered with an ok ACK (measured by the worker at the end of its transition:
its state, and each device's used and free memory) and every other worker was asleep, nothing
on the group's devices moved but what those ACKs measured, so the group is known without a
GetStatus round trip:

- an ACKed worker's report is its last one with the ACK's state, level and figures
  (``report_after_ack``: what its GetStatus would answer);
- an asleep worker nobody ordered keeps its report (an asleep worker takes no memory by itself);
- each device's free memory is the latest ACK's reading of it (``acked_memory``): the promise's
  own figures, taken after the older readings of the same device.

A stage's status shows its worker's own last reading: after a hand-over, the sleeper's device
free memory as its sleep ACK measured it (not read again after the wake, so its status is not
written a second time); the next round's GetStatus brings it up to date.

Anything else (an order without an ok ACK, a replayed ACK, an ACK the device's own figures
contradict, a component sleep that leaves the worker Active, an Active or starting worker that
was not ordered, a worker without a report) asks every worker again (``reuse_reports`` answers
None).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import replace

from omnistage_operator.decisions.arbiter import DeviceMemory, GroupMemory, WorkerPhase
from omnistage_operator.decisions.facts import AckFacts, WorkerReport, ack_contradiction

__all__ = ["acked_memory", "report_after_ack", "reuse_reports"]

# The state an ok ACK of each operation leaves a whole worker in.
_ACKED_STATE = {"sleep": WorkerPhase.ASLEEP, "wake": WorkerPhase.ACTIVE}


def _measured(ack: AckFacts) -> bool:
    """The ACK carries the device's own figures (per device, or the accounting sums)."""
    return any(d.total > 0 for d in ack.devices) or ack.total_bytes > 0


def _trusted(ack: AckFacts) -> bool:
    """An ok ACK, measured at the end of this transition, leaving the worker whole in the
    state its operation promises."""
    return ack.ok and not ack.replayed and _ACKED_STATE.get(ack.op) is ack.state and _measured(ack)


def report_after_ack(report: WorkerReport, ack: AckFacts) -> WorkerReport:
    """``report`` as the worker answers GetStatus right after ``ack``: the ACK's state, level
    and per-device figures (the planned weights per device kept); a wake's footprint and peak
    are what it holds after the wake (the worker sets both then)."""
    weights = {(d.uuid, d.index): d.weights for d in report.devices}
    devices = tuple(
        replace(
            d,
            used_before=d.used_after,
            free_before=d.free_after,
            weights=weights.get((d.uuid, d.index), 0),
        )
        for d in ack.devices
    )
    woke = ack.op == "wake"
    return replace(
        report,
        phase=ack.state,
        level=None if woke else ack.level,
        used_bytes=ack.used_after_bytes,
        free_bytes=ack.free_after_bytes,
        total_bytes=ack.total_bytes or report.total_bytes,
        source=ack.source or report.source,
        active_footprint_bytes=ack.used_after_bytes if woke else report.active_footprint_bytes,
        peak_active_bytes=ack.used_after_bytes if woke else report.peak_active_bytes,
        last_ack=ack,
        devices=devices or report.devices,
        inflight_requests=0 if not woke else report.inflight_requests,
        components=ack.components or report.components,
        epoch=max(report.epoch, ack.epoch),
    )


def reuse_reports(
    reports: Mapping[str, WorkerReport],
    ordered: Collection[str],
    acks: Mapping[str, AckFacts],
    stages: Iterable[str],
) -> dict[str, WorkerReport] | None:
    """The reports of ``stages`` (the workers with a pod) after this round's orders, or None
    when a worker must be asked again. ``reports``: the round's last readings; ``ordered``:
    the stages sent a Sleep or WakeUp since; ``acks``: their ACKs, by stage."""
    out: dict[str, WorkerReport] = {}
    for name in stages:
        last = reports.get(name)
        if last is None:
            return None  # not reached before: it may answer now
        if name in ordered:
            ack = acks.get(name)
            if ack is None or not _trusted(ack):
                return None
            if ack_contradiction(ack, None, last.context_bytes or None) is not None:
                return None  # the device's own figures disagree: nobody's reading is reused
            out[name] = report_after_ack(last, ack)
        elif last.phase is WorkerPhase.ASLEEP and not last.inflight_requests:
            out[name] = last
        else:
            return None
    return out


def acked_memory(memory: GroupMemory, acks: Iterable[AckFacts]) -> GroupMemory:
    """``memory`` with each device's free memory as the latest ACK measured it (by the ACKs'
    end times, worker clock: a group's workers share one node; equal times: the lower reading).
    A device no ACK measured keeps its figures."""
    latest: dict[str, tuple[float, int]] = {}
    scalar: tuple[float, int] | None = None
    for ack in acks:
        for d in ack.devices:
            if d.uuid and d.total > 0:
                seen = latest.get(d.uuid)
                if seen is None or (ack.finished_at, -d.free_after) > (seen[0], -seen[1]):
                    latest[d.uuid] = (ack.finished_at, d.free_after)
        if ack.total_bytes > 0 and (
            scalar is None or (ack.finished_at, -ack.free_after_bytes) > (scalar[0], -scalar[1])
        ):
            scalar = (ack.finished_at, ack.free_after_bytes)
    if memory.devices:
        devices = tuple(
            DeviceMemory(d.uuid, d.total, latest[d.uuid][1]) if d.uuid in latest else d
            for d in memory.devices
        )
        return replace(memory, devices=devices, free=min(d.free for d in devices))
    if scalar is None or memory.free is None:
        return memory
    return replace(memory, free=scalar[1])
