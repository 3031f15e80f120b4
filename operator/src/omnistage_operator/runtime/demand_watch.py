"""One long-lived WatchDemand stream per OnDemand worker: the latest demand, kicks, timers.

No polling: each worker tells its demand at once when it changes; a change that matters (held
requests, the worker's state, requests in flight starting or ending) kicks the group's round,
unless the group's last round already saw it (``seen``: what its last ``shape`` read of the
stream, with the worker's state as the round itself last knew it, from its ACKs). A report that
comes while a round of its group runs is judged when that round ends (``round_ended``; a
round's last plan, after its wakes, orders nothing more, so a report it saw there still kicks
when that plan orders something): the reports of a hand-over's own sleep and wake start no
second round.
A stream that breaks (pod gone, worker restarting) is opened again after a short back-off while
its pod is the stage's. ``shape`` is the round's entry point: it opens the streams the group's
OnDemand stages need, closes the others, and turns the latest demand into the arbiter's
intents (:func:`ondemand.shape_intents`), scheduling a round for when idleness or a residency
ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from omnistage.worker.v1 import demand_service_pb2, types_pb2
from omnistage_operator.decisions.arbiter import StageIntent, WorkerPhase
from omnistage_operator.decisions.handover import (
    WorkerRefused,
    WorkerUnauthenticated,
    WorkerUnavailable,
)
from omnistage_operator.decisions.ondemand import (
    AwakeReason,
    Demand,
    DemandInput,
    DemandView,
    shape_intents,
)
from omnistage_operator.decisions.status import format_timestamp
from omnistage_operator.k8s import metrics

if TYPE_CHECKING:
    from omnistage_operator.k8s.port_host import RoundView
    from omnistage_operator.k8s.worker_client import WorkerClient

__all__ = ["DemandReport", "DemandWatcher", "report_from_proto"]

log = logging.getLogger(__name__)

StageKey = tuple[str, str]
GroupKey = tuple[str, str]
Trigger = tuple[int, bool, bool]
_NO_STREAM = frozenset({WorkerPhase.ABSENT, WorkerPhase.STARTING})
_TRANSITIONS = frozenset({types_pb2.WORKER_STATE_SLEEPING, types_pb2.WORKER_STATE_WAKING})
_RETRY_MIN_S, _RETRY_MAX_S = 0.2, 5.0
# A stage's demand series (labelled namespace, stage), removed when the stage is deleted.
_STAGE_SERIES = (
    metrics.HELD_REQUESTS,
    metrics.HOLD_SECONDS,
    metrics.HELD_SERVED,
    metrics.HELD_TIMED_OUT,
    metrics.HOLD_QUEUE_FULL,
)


@dataclass(frozen=True)
class DemandReport:
    """One WatchDemand message, as plain values (times in Unix seconds)."""

    demand: Demand
    active: bool
    transition: bool = False  # Sleeping or Waking
    held_total: int = 0
    served_after_hold_total: int = 0
    hold_seconds_total: float = 0.0
    hold_timeouts_total: int = 0
    hold_full_total: int = 0

    @property
    def trigger(self) -> Trigger:
        """What kicks a round when it changes."""
        return (self.demand.held, self.active, self.demand.inflight > 0)


def report_from_proto(message: demand_service_pb2.WatchDemandResponse) -> DemandReport:
    def seconds(ts: Any, present: bool) -> float | None:
        return ts.ToNanoseconds() / 1e9 if present else None

    return DemandReport(
        demand=Demand(
            held=message.held_requests,
            oldest_hold_start=seconds(
                message.oldest_hold_start, message.HasField("oldest_hold_start")
            ),
            last_request=seconds(message.last_request_time, message.HasField("last_request_time")),
            inflight=message.inflight_requests,
        ),
        active=message.state == types_pb2.WORKER_STATE_ACTIVE,
        transition=message.state in _TRANSITIONS,
        held_total=message.held_total,
        served_after_hold_total=message.served_after_hold_total,
        hold_seconds_total=message.hold_seconds_total,
        hold_timeouts_total=message.hold_timeouts_total,
        hold_full_total=message.hold_full_total,
    )


@dataclass
class _Stream:
    uid: str
    group: str
    task: asyncio.Task[None]
    report: DemandReport | None = None
    awake_since: float | None = None
    # The trigger as the group's last round saw it: held and in-flight from the report its
    # last shape read, Active from the worker's phase there (None: no report read yet).
    seen: Trigger | None = None


@dataclass
class _Round:
    """A group's round while it runs: the stages whose reports came meanwhile, and whether its
    last plan (after its wakes, which nothing follows) still orders something."""

    reported: set[StageKey] = field(default_factory=set)
    orders_left: bool = False


@dataclass
class _Timers:
    handles: dict[tuple[str, str], asyncio.TimerHandle] = field(default_factory=dict)


class DemandWatcher:
    """The demand streams of one operator process."""

    def __init__(self, kick: Callable[[str, str], None], epoch: Callable[[str], int]) -> None:
        self._kick = kick
        self._epoch = epoch
        self._streams: dict[StageKey, _Stream] = {}
        self._timers = _Timers()
        self._in_round: dict[GroupKey, _Round] = {}  # groups with a round running

    # -- the round's view ------------------------------------------------------------------

    def shape(
        self, port: RoundView, intents: Mapping[str, StageIntent], now: float | None = None
    ) -> DemandView:
        """Open or close the group's streams, then the intents shaped by demand."""
        now = time.time() if now is None else now
        inputs: dict[str, DemandInput] = {}
        for name in intents:
            spec = port.specs[name]
            key = (port.ns, name)
            fact = port.facts[name]
            pod = port.pods.get(name)
            deleting = bool(port.bodies[name]["metadata"].get("deletionTimestamp"))
            # no stream to a deleted stage's worker: it would hold the pod's termination (a
            # worker's gRPC server waits for its open calls) for its whole grace period
            if not spec.activation.on_demand or pod is None or fact.phase in _NO_STREAM or deleting:
                self.drop(*key)
                if spec.activation.on_demand:
                    inputs[name] = DemandInput(spec.activation, fact.phase, deleting=deleting)
                continue
            client = port.r.client_for(port.ns, spec, pod)
            if client is not None:
                self._ensure(key, port.group, pod["metadata"]["uid"], client)
            stream = self._streams.get(key)
            if (
                stream is not None
                and fact.phase is WorkerPhase.ACTIVE
                and stream.awake_since is None
            ):
                stream.awake_since = now  # seen Active by the round before the stream said so
            if stream is not None:
                stream.seen = _seen(stream.report, fact.phase)
            inputs[name] = DemandInput(
                spec.activation,
                fact.phase,
                stream.report.demand if stream is not None and stream.report else None,
                stream.awake_since if stream is not None else None,
                asleep_asked_at=port.r.asleep_asked.get(key),
                asleep_pending=key in port.r.asleep_restored,
                batching=port.r.views.batching(port.ns, name),
            )
        view = shape_intents(intents, inputs, now)
        self._schedule(port.ns, port.group, view.recheck_at, now)
        return view

    def round_began(self, namespace: str, group: str) -> None:
        """A round of the group begins: its streams' reports wait for its end."""
        self._in_round[(namespace, group)] = _Round()

    def round_ordered(self, namespace: str, group: str) -> None:
        """The running round's last plan orders something that no later plan acts on."""
        running = self._in_round.get((namespace, group))
        if running is not None:
            running.orders_left = True

    def round_ended(self, namespace: str, group: str) -> None:
        """The group's round ended: kick it again when a report that came meanwhile says
        something its last shape did not see, or its last shape saw it but the round gave no
        more orders after it (:meth:`round_ordered`)."""
        ended = self._in_round.pop((namespace, group), _Round())
        streams = [s for key in ended.reported if (s := self._streams.get(key)) is not None]
        if streams and (ended.orders_left or any(_news(s) for s in streams)):
            self._kick(namespace, group)

    def status_fields(
        self, namespace: str, name: str, reason: AwakeReason | None
    ) -> dict[str, Any]:
        """``status.demand`` and ``status.awakeReason`` of a stage (None clears them)."""
        stream = self._streams.get((namespace, name))
        report = stream.report if stream is not None else None
        demand: dict[str, Any] | None = None
        if report is not None:
            d = report.demand
            demand = {
                "heldRequests": d.held,
                "oldestHoldStart": (
                    format_timestamp(d.oldest_hold_start) if d.oldest_hold_start else None
                ),
                "lastRequestTime": format_timestamp(d.last_request) if d.last_request else None,
            }
        return {"demand": demand, "awakeReason": reason.value if reason is not None else None}

    def report(self, namespace: str, name: str) -> DemandReport | None:
        """A stage's latest demand report (None: no stream or no report yet)."""
        stream = self._streams.get((namespace, name))
        return stream.report if stream is not None else None

    def held(self, namespace: str, name: str) -> tuple[int, float | None]:
        """Held requests of a stage now and when the oldest was held."""
        stream = self._streams.get((namespace, name))
        if stream is None or stream.report is None:
            return 0, None
        return stream.report.demand.held, stream.report.demand.oldest_hold_start

    # -- streams ---------------------------------------------------------------------------

    def _ensure(self, key: StageKey, group: str, uid: str, client: WorkerClient) -> None:
        stream = self._streams.get(key)
        if stream is not None and stream.uid == uid and not stream.task.done():
            return
        self.drop(*key)
        task = asyncio.create_task(self._follow(key, group, client), name=f"demand {key}")
        self._streams[key] = _Stream(uid, group, task)

    def drop(self, namespace: str, name: str) -> None:
        """Close a stage's stream (its pod went away, or it is no longer OnDemand)."""
        stream = self._streams.pop((namespace, name), None)
        if stream is not None:
            stream.task.cancel()
            metrics.HELD_REQUESTS.labels(namespace, name).set(0)

    def forget(self, namespace: str, name: str) -> None:
        """Close a deleted stage's stream and remove its series."""
        self.drop(namespace, name)
        for metric in _STAGE_SERIES:
            metric.remove(namespace, name)

    def drop_group(self, namespace: str, group: str) -> None:
        """Cancel a gone group's recheck timer."""
        handle = self._timers.handles.pop((namespace, group), None)
        if handle is not None:
            handle.cancel()

    def entries(self) -> int:
        """Streams and timers kept (``omnistage_runner_entries``)."""
        return len(self._streams) + len(self._timers.handles)

    async def close(self) -> None:
        """Close every stream and timer."""
        for handle in self._timers.handles.values():
            handle.cancel()
        tasks = [s.task for s in self._streams.values()]
        self._streams.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _follow(self, key: StageKey, group: str, client: WorkerClient) -> None:
        retry = _RETRY_MIN_S
        while True:
            try:
                async for message in client.watch_demand(self._epoch(key[0])):
                    self._on_report(key, group, report_from_proto(message))
                    retry = _RETRY_MIN_S
            except (WorkerUnavailable, WorkerRefused, WorkerUnauthenticated) as exc:
                log.debug("demand stream of %s/%s: %s", *key, exc)
            await asyncio.sleep(retry)
            retry = min(retry * 2, _RETRY_MAX_S)

    def _on_report(self, key: StageKey, group: str, report: DemandReport) -> None:
        stream = self._streams.get(key)
        if stream is None:
            return
        before = stream.report
        stream.report = report
        if report.active and (before is None or not before.active):
            stream.awake_since = time.time()
        elif not report.active:
            stream.awake_since = None
        _count(key, before, report)
        if not _news(stream):
            return
        running = self._in_round.get((key[0], group))
        if running is not None:
            running.reported.add(key)  # judged when the round ends (it may see it itself)
        else:
            self._kick(key[0], group)

    def _schedule(self, namespace: str, group: str, at: float | None, now: float) -> None:
        gkey = (namespace, group)
        old = self._timers.handles.pop(gkey, None)
        if old is not None:
            old.cancel()
        if at is not None:
            delay = max(0.0, at - now) + 0.01
            loop = asyncio.get_running_loop()
            self._timers.handles[gkey] = loop.call_later(delay, self._recheck, namespace, group)

    def _recheck(self, namespace: str, group: str) -> None:
        self._timers.handles.pop((namespace, group), None)
        self._kick(namespace, group)


def _seen(report: DemandReport | None, phase: WorkerPhase) -> Trigger | None:
    """The trigger a round saw: the report's held and in-flight, the round's own phase."""
    if report is None:
        return None
    return (report.demand.held, phase is WorkerPhase.ACTIVE, report.demand.inflight > 0)


def _news(stream: _Stream) -> bool:
    """The stream's latest report says something the group's last round did not see. A
    worker in a transition says nothing new of its state: the round that ordered it sees its
    end (its ACK), and the report of that end is news when it was not (such a report may
    also come after the ACK)."""
    report, seen = stream.report, stream.seen
    if report is None:
        return False
    if seen is None:
        return True
    held, active, inflight = report.trigger
    if (held, inflight) != (seen[0], seen[2]):
        return True
    return active != seen[1] and not report.transition


def _count(key: StageKey, before: DemandReport | None, now: DemandReport) -> None:
    """Prometheus: the held gauge, and the workers' totals as counters (a restarted worker
    counts from zero again)."""
    ns, name = key
    metrics.HELD_REQUESTS.labels(ns, name).set(now.demand.held)

    def delta(new: float, old: float | None) -> float:
        if old is None:
            return new
        return new - old if new >= old else new

    pairs = (
        (metrics.HOLD_SECONDS, now.hold_seconds_total, before and before.hold_seconds_total),
        (
            metrics.HELD_SERVED,
            now.served_after_hold_total,
            before and before.served_after_hold_total,
        ),
        (metrics.HELD_TIMED_OUT, now.hold_timeouts_total, before and before.hold_timeouts_total),
        (metrics.HOLD_QUEUE_FULL, now.hold_full_total, before and before.hold_full_total),
    )
    for counter, new, old in pairs:
        step = delta(float(new), None if before is None else float(old or 0))
        if step > 0:
            counter.labels(ns, name).inc(step)
