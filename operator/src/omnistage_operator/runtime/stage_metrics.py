"""Per-stage and per-device gauges and the ACK verdicts of a round (Prometheus).

Gauges follow the status the operator publishes (``observe``, once per stage and round), so
what Prometheus shows is what ``kubectl get omnistage`` shows; a deleted stage's series are
removed (``forget``), and so are a gone group's (``forget_group``: batched, one pass over each
metric per second however many groups went). Verdicts are counted from a round's outcome
(``record_round``): a sleep ACK is ``ok``, ``contradicted`` (ok, but the device's own figures
disagree), ``failed`` (not ok), ``refused`` or ``no_ack``; a wake ACK ``ok``,
``out_of_memory`` or ``failed``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping
from typing import Any

from omnistage_operator.decisions.handover import RoundOutcome, SleepResult
from omnistage_operator.k8s import metrics

__all__ = [
    "STATES",
    "flush_groups",
    "forget",
    "forget_group",
    "observe",
    "record_round",
    "sleep_verdict",
]

# The states a status reports (the CRD's enum).
STATES = ("Pending", "Loading", "Active", "Sleeping", "Asleep", "Waking", "Waiting", "Failed")

StageKey = tuple[str, str]
# Label values set per stage, so that a change (a new wait reason, a device) or a deletion
# removes the old series instead of leaving them at their last value.
_waiting: dict[StageKey, tuple[str, ...]] = {}
_devices: dict[StageKey, list[tuple[str, ...]]] = {}
_groups: dict[StageKey, str] = {}

GroupKey = tuple[str, str]
# The series labelled by group: (metric, its labels after namespace and group).
_GROUP_SERIES: tuple[tuple[Any, tuple[str, ...]], ...] = (
    (metrics.ROUNDS, ("outcome",)),
    (metrics.ACK_VERDICTS, ("op", "verdict")),
    (metrics.WAITS, ("reason",)),
    (metrics.TRANSITIONS, ("op", "result")),
    (metrics.FENCES, ("result",)),
    (metrics.HANDOVER_SECONDS, ()),
    (metrics.BYTES_FREED, ()),
    (metrics.ROUNDS_FROM_KEPT, ()),
    (metrics.ROUND_API_REQUESTS, ()),
    (metrics.ROUND_API_OBJECTS, ()),
    (metrics.DEMAND_WAKES, ()),
    (metrics.DEMAND_SWAPS, ()),
    (metrics.IDLE_SLEEPS, ()),
)
FLUSH_S = 1.0
# Gone groups whose series are not removed yet: whether the group is back (kept then).
_gone: dict[GroupKey, Callable[[], bool]] = {}
_flush: list[asyncio.AbstractEventLoop] = []  # the loop a flush is pending on


def sleep_verdict(s: SleepResult) -> str:
    """What a sleep's ACK proved."""
    if s.ok:
        return "ok"
    if s.contradiction:
        return "contradicted"
    if s.ack is not None:
        return "failed"
    return "refused" if s.refusal is not None else "no_ack"


def record_round(namespace: str, group: str, outcome: RoundOutcome) -> None:
    """Count the verdicts of the round's sleep and wake ACKs (and a plan from kept readings)."""
    if outcome.from_kept:
        metrics.ROUNDS_FROM_KEPT.labels(namespace, group).inc()
    for s in outcome.sleeps:
        metrics.ACK_VERDICTS.labels(namespace, group, "sleep", sleep_verdict(s)).inc()
    for name, ack in outcome.wakes.items():
        verdict = "ok" if ack.ok else "out_of_memory" if name in outcome.wake_oom else "failed"
        metrics.ACK_VERDICTS.labels(namespace, group, "wake", verdict).inc()
    for name in outcome.wake_oom:
        if name not in outcome.wakes:
            metrics.ACK_VERDICTS.labels(namespace, group, "wake", "out_of_memory").inc()


def observe(namespace: str, group: str, stage: str, status: Mapping[str, Any]) -> None:
    """Set the stage's gauges from the status just built for it."""
    key = (namespace, stage)
    if _groups.get(key, group) != group:
        forget(namespace, stage)
    _groups[key] = group
    state = status.get("state")
    for name in STATES:
        metrics.STAGE_STATE.labels(namespace, group, stage, name).set(1 if name == state else 0)
    reason = str(status.get("waitReason") or "")
    old = _waiting.pop(key, None)
    if old is not None and old[-1] != reason:
        _remove(metrics.STAGE_WAITING, *old)
    if reason:
        if old is None or old[-1] != reason:
            metrics.WAITS.labels(namespace, group, reason).inc()
        labels = (namespace, group, stage, reason)
        metrics.STAGE_WAITING.labels(*labels).set(1)
        _waiting[key] = labels
    level = status.get("sleepLevel")
    metrics.STAGE_SLEEP_LEVEL.labels(namespace, group, stage).set(int(level or 0))
    _set_devices(key, group, status.get("devices") or ())


def _set_devices(key: StageKey, group: str, devices: Any) -> None:
    namespace, stage = key
    seen: list[tuple[str, ...]] = []
    for d in devices:
        device = str(d.get("uuid") or d.get("index", ""))
        labels: tuple[str, ...] = (namespace, group, stage, device)
        metrics.STAGE_DEVICE_USED.labels(*labels).set(int(d.get("usedBytes") or 0))
        metrics.DEVICE_FREE.labels(device).set(int(d.get("freeBytes") or 0))
        metrics.DEVICE_TOTAL.labels(device).set(int(d.get("totalBytes") or 0))
        seen.append(labels)
    for labels in _devices.get(key, ()):
        if labels not in seen:
            metrics.STAGE_DEVICE_USED.remove(*labels)
    _devices[key] = seen


def forget(namespace: str, stage: str) -> None:
    """Remove a deleted stage's series."""
    key = (namespace, stage)
    group = _groups.pop(key, None)
    if group is None:
        return
    for name in STATES:
        _remove(metrics.STAGE_STATE, namespace, group, stage, name)
    _remove(metrics.STAGE_SLEEP_LEVEL, namespace, group, stage)
    waiting = _waiting.pop(key, None)
    if waiting is not None:
        _remove(metrics.STAGE_WAITING, *waiting)
    for labels in _devices.pop(key, ()):
        _remove(metrics.STAGE_DEVICE_USED, *labels)


def _remove(metric: Any, *labels: str) -> None:
    with contextlib.suppress(KeyError):
        metric.remove(*labels)


def forget_group(namespace: str, group: str, back: Callable[[], bool] = lambda: False) -> None:
    """Remove a gone group's series within ``FLUSH_S`` (``back``: the group is in use again,
    its series are kept)."""
    _gone[(namespace, group)] = back
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        flush_groups()
        return
    if not _flush or _flush[0] is not loop:  # none pending on this loop
        _flush[:] = [loop]
        loop.call_later(FLUSH_S, flush_groups)


def flush_groups() -> int:
    """Remove the series of the groups gone since the last flush; how many groups."""
    gone = {key for key, back in _gone.items() if not back()}
    _gone.clear()
    _flush.clear()
    for metric, extra in _GROUP_SERIES:
        if not extra:
            for key in gone:
                _remove(metric, *key)
            continue
        names = ("namespace", "group", *extra)
        series = {
            tuple(s.labels[n] for n in names)
            for family in metric.collect()
            for s in family.samples
            if (s.labels.get("namespace"), s.labels.get("group")) in gone
        }
        for labels in series:
            _remove(metric, *labels)
    return len(gone)
