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

A group's readings at the end of a round are kept for its next round (``KeptReadings``): while
they are still the group's (``kept_reports``: the same leadership epoch, the same worker pods at
the same resourceVersion, every worker Active or Asleep, at most ``KEPT_MAX_AGE_S`` old), that
round plans its first step from them, without a GetStatus round trip before its first Sleep,
when that step puts every Active stage to sleep whole (``handover.rounds``); the asleep workers
are read beside those sleeps. The gate after them then reads the group as above (the asleep
workers from those answers), only when their ACKs measured every device the readings name
(``acks_measure``); otherwise every worker is read. No wake, fence or pod creation is decided
from kept readings.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, replace

from omnistage_operator.decisions.arbiter import DeviceMemory, GroupMemory, WorkerPhase
from omnistage_operator.decisions.facts import AckFacts, WorkerReport, ack_contradiction

__all__ = [
    "KEPT_MAX_AGE_S",
    "KeptReadings",
    "acked_memory",
    "acks_measure",
    "keep_readings",
    "kept_reports",
    "report_after_ack",
    "reuse_reports",
]

# How long a group's last readings may plan its next round's sleeps (a resync round reads the
# workers at least every --resync-interval, 10 s by default, and keeps what it read).
KEPT_MAX_AGE_S = 10.0
# The phases a kept reading may show: a worker in a transition, starting, failed or lost is read.
_SETTLED = frozenset({WorkerPhase.ACTIVE, WorkerPhase.ASLEEP})

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
    are what it holds after the wake (the worker sets both then), a sleep's peak the ACK's."""
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
        # a sleep's ACK carries the peak as the worker keeps it (requests served since the
        # reading raise it); a wake's, the peak before it
        peak_active_bytes=(
            ack.used_after_bytes if woke else ack.peak_active_bytes or report.peak_active_bytes
        ),
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
            if ack_contradiction(ack, None, last.context_bytes or None, rejudged=True):
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


PodKeys = Mapping[str, tuple[str, str]]  # stage -> (pod uid, resourceVersion)


@dataclass(frozen=True)
class KeptReadings:
    """A group's readings at the end of a round: each worker's report, the pods they came from
    (uid and resourceVersion, by stage), the leadership epoch and when (monotonic seconds)."""

    reports: Mapping[str, WorkerReport]
    pods: PodKeys
    epoch: int
    at: float


def keep_readings(
    reports: Mapping[str, WorkerReport], pods: PodKeys, epoch: int, at: float
) -> KeptReadings | None:
    """The readings worth keeping: every worker with a pod read, each Active or Asleep whole
    (no component asleep or in a transition), none with requests in flight; else None."""
    if set(reports) != set(pods):
        return None
    for report in reports.values():
        if report.phase not in _SETTLED or report.inflight_requests:
            return None
        if report.phase is WorkerPhase.ACTIVE and any(c.asleep for c in report.components):
            return None
    return KeptReadings(dict(reports), dict(pods), epoch, at)


def kept_reports(
    kept: KeptReadings | None, pods: PodKeys, epoch: int, now: float
) -> dict[str, WorkerReport] | None:
    """The kept reports while they are still the group's: the same epoch, the same pods at the
    same resourceVersion (a pod that changed, was replaced or is new is read), not older than
    ``KEPT_MAX_AGE_S``; else None."""
    if kept is None or kept.epoch != epoch or dict(pods) != dict(kept.pods):
        return None
    if not 0 <= now - kept.at <= KEPT_MAX_AGE_S:
        return None
    return dict(kept.reports)


def acks_measure(reports: Iterable[WorkerReport], acks: Iterable[AckFacts]) -> bool:
    """The ACKs measured every device the reports name (by UUID; without per-device figures,
    some ACK carries the device's sums): the gate then reads no device from older readings."""
    acked = list(acks)
    measured = {d.uuid for a in acked for d in a.devices if d.uuid and d.total > 0}
    named = {d.uuid for r in reports for d in r.devices if d.uuid and d.total > 0}
    if named:
        return named <= measured
    return any(a.total_bytes > 0 for a in acked)
