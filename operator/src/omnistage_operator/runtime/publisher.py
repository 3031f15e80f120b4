"""Status and Events of a group's stages after a round (``StatusPublisher``, mixed into
``runner.GroupRunner``).

The status body comes from ``status.build_status`` (pure); this module adds what only the
Kubernetes side knows (per-device figures, the crash and wake back-offs, a pending patch to
Asleep: read back by a restarted operator, ``remembered``), patches status only where it
changed, and records Events: the round's own (Slept, Woken, refusals, PodCreated) and a Warning
whenever a condition takes a reason a user must hear about.

The Events of a round's status are posted after its status writes (the checkpoint's after the
round's last publish): on a single event loop, posting them first would put them ahead of the
status writes and the wake on the hand-over's path. They then wait in ``event_lane`` until no
round runs (a storm's Events after its hand-overs), in order per stage, none dropped. A state
change the round's own Event on the stage names (Slept, Woken, Waiting) is told in that Event,
not in a ``StateChanged`` of its own (``state_events``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Coroutine, Mapping
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from omnistage_operator.api import conditions as cond
from omnistage_operator.decisions.ambient import all_shown, deferred, only_free_moved, shown_free
from omnistage_operator.decisions.arbiter import StageFacts, WorkerPhase
from omnistage_operator.decisions.facts import AckFacts
from omnistage_operator.decisions.handover import RoundOutcome
from omnistage_operator.decisions.peaks import StagePeaks
from omnistage_operator.decisions.peaks import to_status as peaks_to_status
from omnistage_operator.decisions.pods import CrashBackoff
from omnistage_operator.decisions.state_events import STATE_CHANGED, fold_state_changes
from omnistage_operator.decisions.status import (
    StageObservation,
    build_status,
    format_timestamp,
    wait_cause,
)
from omnistage_operator.decisions.wake_backoff import WakeBackoff
from omnistage_operator.decisions.wake_backoff import to_status as wake_backoff_status
from omnistage_operator.k8s import metrics
from omnistage_operator.k8s.kube import OMNISTAGE, Kube, KubeError, tally_context
from omnistage_operator.runtime import stage_metrics
from omnistage_operator.runtime.event_lane import EventLane
from omnistage_worker.quantities import format_bytes

if TYPE_CHECKING:
    from omnistage_operator.k8s.port_host import RoundView
    from omnistage_operator.runtime.demand_watch import DemandWatcher

__all__ = ["StatusPublisher"]

log = logging.getLogger(__name__)

StageKey = tuple[str, str]
HeldEvent = tuple[Mapping[str, Any], str, str, bool]  # body, reason, message, warning
# While a publish builds its status: where its Events wait (the port's ``held_events``).
_HELD: ContextVar[list[HeldEvent] | None] = ContextVar("omnistage_held_events", default=None)
# Condition reasons that are news for a user: an Event (Warning) when a condition takes one.
_WARN_REASONS = frozenset(
    {
        cond.Reason.LARGER_THAN_DEVICE,
        cond.Reason.DEVICE_MISMATCH,
        cond.Reason.CLAIM_TOO_SMALL,
        cond.Reason.ACK_CONTRADICTED,
        cond.Reason.FENCE_PENDING,
        cond.Reason.WORKER_FAILED,
        cond.Reason.SLEEP_REFUSED,
        cond.Reason.WAKE_REFUSED,
        "WorkerExited",
    }
)


class StatusPublisher:
    """Publishing half of ``GroupRunner`` (the attributes below are the runner's)."""

    kube: Kube
    published: dict[StageKey, dict[str, Any]]
    written_at: dict[StageKey, float]  # monotonic: when ``published`` was last written
    asks: dict[StageKey, float]
    last_acks: dict[StageKey, AckFacts]
    fenced: dict[StageKey, str]
    auth_errors: dict[StageKey, str]
    fence_pending: dict[StageKey, str]
    learned: dict[StageKey, int]
    peaks: dict[StageKey, StagePeaks]
    backoffs: dict[StageKey, CrashBackoff]
    wake_backoffs: dict[StageKey, WakeBackoff]
    asleep_asked: dict[StageKey, float]
    sleep_problems: dict[StageKey, tuple[str, str]]
    wake_problems: dict[StageKey, tuple[str, str]]
    component_problems: dict[StageKey, tuple[str, str]]
    stage_problems: dict[StageKey, tuple[str, str]]
    event_lane: EventLane
    demand: DemandWatcher

    def emit(
        self, body: Mapping[str, Any], reason: str, message: str, *, warning: bool = False
    ) -> None:
        """Record an Event without blocking the hand-over (inside a publish: once its status is
        written)."""
        meta = body["metadata"]
        level = logging.WARNING if warning else logging.INFO
        log.log(level, "%s/%s %s: %s", meta.get("namespace"), meta["name"], reason, message)
        held = _HELD.get()
        if held is not None:
            held.append((body, reason, message, warning))
            return
        self._post(body, reason, message, warning)

    def _post(self, body: Mapping[str, Any], reason: str, message: str, warning: bool) -> None:
        """Hand the Event to the low-priority lane (``event_lane``): posted once no round
        runs, in order per stage."""
        meta = body["metadata"]
        post = functools.partial(
            self.kube.event, body, reason=reason, message=message, warning=warning
        )
        self.event_lane.put((meta.get("namespace"), meta["name"]), post, tally_context())

    def rounds_idle(self) -> None:
        """No round runs now: the Events held may go (``GroupLoops``' hook)."""
        self.event_lane.wake()

    def _events(self, port: RoundView, outcome: RoundOutcome) -> None:
        for s in outcome.sleeps:
            body = port.bodies.get(s.order.stage)
            if body is None:
                continue
            if s.ok and s.ack is not None and s.order.components:
                a = s.ack
                msg = (
                    f"ACK {a.task_id}: {', '.join(s.order.components)} asleep at level "
                    f"{s.order.level}, freed {format_bytes(max(a.freed_bytes, 0))}; the worker "
                    f"stays Active with {format_bytes(a.used_after_bytes)} ({a.source})"
                )
                self.emit(body, "ComponentsSlept", msg)
            elif s.ok and s.ack is not None:
                a = s.ack
                freed = format_bytes(max(a.freed_bytes, 0))
                msg = (
                    f"ACK {a.task_id}: level {a.level}, freed {freed}, used after "
                    f"{format_bytes(a.used_after_bytes)} ({a.source}), {a.duration_s:.3f}s"
                )
                self.emit(body, "Slept", msg)
            else:  # the worker's words, or the device's figures, on why it was not ok
                self.emit(body, s.reason.value, f"{s.task_id}: {s.message}", warning=True)
        for name, a in outcome.wakes.items():
            body = port.bodies.get(name)
            if body is not None and a.ok:
                used = format_bytes(a.used_after_bytes)
                msg = f"ACK {a.task_id}: used {used} ({a.source}), {a.duration_s:.3f}s"
                parts = name in outcome.component_wakes
                self.emit(body, "ComponentsWoken" if parts else "Woken", msg)
        self._demand_events(port, outcome)
        for name, err in outcome.wake_errors.items():
            body = port.bodies.get(name)
            if body is not None:
                refused = name in outcome.wake_refusals
                self.emit(body, "WakeRefused" if refused else "WakeFailed", err, warning=True)
        for name in outcome.started:
            body = port.bodies.get(name)
            if body is not None:
                self.emit(body, "PodCreated", "worker pod created asleep")
        for name, err in outcome.stage_errors.items():
            body = port.bodies.get(name)
            if body is not None:
                self.emit(body, cond.Reason.STAGE_ERROR.value, err, warning=True)

    def _demand_events(self, port: RoundView, outcome: RoundOutcome) -> None:
        """Events and metrics of demand-driven wakes (a swap when another stage slept) and of
        idle sleeps."""
        slept = [s.order.stage for s in outcome.sleeps if s.ok]
        for name, a in outcome.wakes.items():
            body = port.bodies.get(name)
            if body is None or not a.ok or name not in port.demand_asked:
                continue
            held, since = port.demand_asked[name]
            waited = f", oldest held {time.time() - since:.2f}s" if since is not None else ""
            swapped = f"; slept {', '.join(slept)} for it" if slept else ""
            metrics.DEMAND_WAKES.labels(port.ns, port.group).inc()
            if slept:
                metrics.DEMAND_SWAPS.labels(port.ns, port.group).inc()
            self.emit(body, "DemandWake", f"woken for {held} held request(s){waited}{swapped}")
        for name in slept:
            body = port.bodies.get(name)
            if body is not None and name in port.demand_idle:
                metrics.IDLE_SLEEPS.labels(port.ns, port.group).inc()
                idle_after = port.specs[name].activation.idle_after_s
                self.emit(body, "IdleSleep", f"no request for {idle_after:g}s: put to sleep")

    async def publish(
        self,
        port: RoundView,
        outcome: RoundOutcome,
        *,
        events: bool = True,
        stages: frozenset[str] | None = None,
    ) -> None:
        """Patch every stage's status (of ``stages`` only, when given) from the facts (only
        where it changed): the writes that change a stage's state first, the others once those
        are answered (a stage's new state does not share the API server with another stage's
        new figures); then post the Events (a checkpoint's, ``events=False``, wait for the
        round's last publish)."""
        token = _HELD.set(port.held_events)
        try:
            states, figures = self._status_patches(port, outcome, events=events, stages=stages)
        finally:
            _HELD.reset(token)
        try:
            await asyncio.gather(*states)
        except BaseException:
            for write in figures:
                write.close()  # never started
            raise
        await asyncio.gather(*figures)
        if events:
            held = fold_state_changes(port.held_events)  # one Event where one tells it
            port.held_events.clear()
            for body, reason, message, warning in held:
                self._post(body, reason, message, warning)

    def _status_patches(
        self,
        port: RoundView,
        outcome: RoundOutcome,
        *,
        events: bool,
        stages: frozenset[str] | None = None,
    ) -> tuple[list[Coroutine[Any, Any, None]], list[Coroutine[Any, Any, None]]]:
        """Build every stage's status (of ``stages`` only, when given); the patches of those
        that changed (not started): those whose state changed, and the others."""
        if events:
            self._events(port, outcome)
        decision = outcome.decision
        now = datetime.now(UTC)
        states: list[Coroutine[Any, Any, None]] = []
        patches: list[Coroutine[Any, Any, None]] = []
        refresh: list[tuple[str, dict[str, Any]]] = []  # only the free memory moved, long ago
        for name, spec in port.specs.items():
            if stages is not None and name not in stages:
                continue
            key = (port.ns, name)
            body = port.bodies[name]
            fact = port.facts.get(name, StageFacts(WorkerPhase.ABSENT))
            if fact.phase is WorkerPhase.ACTIVE:
                self.fenced.pop(key, None)
                self.wake_problems.pop(key, None)
                self.stage_problems.pop(key, None)
            pod = port.pods.get(name)
            # An OnDemand stage woken for its requests wants Active as much as a manual ask.
            wanted = spec.wants_active or name in port.demand.reasons
            obs = StageObservation(
                generation=spec.generation,
                wants_active=wanted,
                phase=fact.phase,
                report=port.reports.get(name),
                pod=pod["metadata"]["name"] if pod else None,
                node=(pod.get("spec") or {}).get("nodeName") if pod else None,
                last_ack=self.last_acks.get(key),
                admitted=decision is not None and name in decision.admitted,
                waiting=decision.waiting.get(name, ()) if decision is not None else (),
                fenced_reason=self.fenced.get(key),
                requested_active_at=_asked_at(self.asks.get(key), port, name),
                sleep_level=spec.sleep_level,
                waking=decision is not None and name in decision.wake,
                worker_error=self.auth_errors.get(key),
                fence_pending=self.fence_pending.get(key),
                learned_need=self.learned.get(key) or None,
                sleep_problem=self.sleep_problems.get(key),
                wake_problem=self.wake_problems.get(key),
                asleep_components=spec.asleep_components,
                components_waiting=(
                    decision.components_waiting.get(name, ()) if decision is not None else ()
                ),
                component_problem=self.component_problems.get(key),
                stage_problem=self.stage_problems.get(key),
                peaks=peaks_to_status(self.peaks.get(key)),
                ack_contradicted=fact.ack_contradicted,
            )
            previous = self.published.get(key) or body.get("status") or {}
            status = build_status(obs, previous, now)
            self._extend_status(status, port, name, now)
            if not body["metadata"].get("deletionTimestamp"):  # its series go with it (forget)
                stage_metrics.observe(port.ns, port.group, name, status)
            self._condition_events(body, previous, status)
            self._wait_event(body, previous, status)
            written = self.published.get(key)
            age = time.monotonic() - self.written_at.get(key, float("-inf"))
            if _same(status, written) or deferred(written, status, age):
                continue  # unchanged, or only the devices' free memory moved (``ambient``)
            if only_free_moved(written, status):  # only that, and the last write is old: a
                refresh.append((name, status))  # refresh, unless another stage shows it (below)
                continue
            old_state = previous.get("state")
            if old_state != status["state"]:
                self.emit(body, STATE_CHANGED, f"{old_state or 'None'} -> {status['state']}")
            self.published[key] = status
            self.written_at[key] = time.monotonic()
            write = self._patch_status(port.ns, name, status, port.after_checkpoint(name))
            (states if old_state != status["state"] else patches).append(write)
        for name, status in refresh:  # judged once this round's other writes are known
            if all_shown(status, self._free_shown(port, name)):
                continue
            self.published[(port.ns, name)] = status
            self.written_at[(port.ns, name)] = time.monotonic()
            patches.append(self._patch_status(port.ns, name, status, port.after_checkpoint(name)))
        for name, (body, exc) in port.invalid.items():
            if stages is not None and name not in stages:
                continue
            status = {"state": "Failed", "observedGeneration": body["metadata"].get("generation")}
            if not body["metadata"].get("deletionTimestamp"):
                stage_metrics.observe(port.ns, port.group, name, status)
            if _same(status, self.published.get((port.ns, name))):
                continue
            self.published[(port.ns, name)] = status
            self.emit(body, "SpecInvalid", str(exc), warning=True)
            patches.append(self._patch_status(port.ns, name, status, port.after_checkpoint(name)))
        return states, patches

    def _free_shown(self, port: RoundView, name: str) -> dict[str, int]:
        """Each device's free memory as the group's other stages' last written statuses show it
        (``ambient.shown_free``)."""
        others = (n for n in port.specs if n != name)
        return shown_free(
            (self.written_at.get((port.ns, n), float("-inf")), self.published.get((port.ns, n)))
            for n in others
        )

    def _extend_status(
        self, status: dict[str, Any], port: RoundView, name: str, now: datetime
    ) -> None:
        """Per-device figures and the crash back-off, which ``build_status`` does not know."""
        key = (port.ns, name)
        rep = port.reports.get(name)
        devices = [
            {
                "uuid": d.uuid or None,
                "index": d.index,
                "usedBytes": d.used_after,
                "freeBytes": d.free_after,
                "totalBytes": d.total,
                "used": format_bytes(d.used_after),
                "free": format_bytes(d.free_after),
                "total": format_bytes(d.total),
            }
            for d in (rep.devices if rep is not None else ())
            if d.total > 0
        ]
        status["devices"] = devices or None
        status["wakeBackoff"] = wake_backoff_status(self.wake_backoffs.get(key))
        on_demand = port.specs[name].activation.on_demand
        if on_demand or name in port.demand.reasons:
            status.update(self.demand.status_fields(port.ns, name, port.demand.reasons.get(name)))
        asked = self.asleep_asked.get(key) if on_demand else None
        status["asleepAskedAt"] = format_timestamp(asked) if asked is not None else None
        backoff = self.backoffs.get(key)
        if backoff is None:
            status["backoff"] = None
            return
        status["backoff"] = {
            "restarts": backoff.restarts,
            "until": format_timestamp(backoff.until),
            "message": backoff.message,
        }
        if name in port.held_back or port.facts.get(name, StageFacts(WorkerPhase.ABSENT)).phase in (
            WorkerPhase.ABSENT,
            WorkerPhase.STARTING,
        ):
            # Its worker exited and no new one answers yet: say so, in the worker's words.
            if name in port.held_back:
                status["state"] = "Failed"
            left = port.held_back.get(name, 0.0)
            msg = f"{backoff.message} (exited {backoff.restarts}x"
            msg += f"; next pod in {left:.0f}s)" if left else "; new pod starting)"
            status["conditions"] = cond.set_condition(
                status.get("conditions"), cond.READY, False, "WorkerExited", msg,
                port.specs[name].generation, now,
            )  # fmt: skip

    def _wait_event(
        self, body: Mapping[str, Any], previous: Mapping[str, Any], status: Mapping[str, Any]
    ) -> None:
        """A ``Waiting`` Event when what the stage waits for changes (its reason or who is in
        the way), with the figures; not every round the figures move."""
        cause = wait_cause(status)
        if cause is None or cause == wait_cause(previous):
            return
        entries = "; ".join(status.get("waitingFor") or ())
        admitted = cond.get_condition(status.get("conditions"), cond.ADMITTED) or {}
        message = str(admitted.get("message") or entries)
        self.emit(body, "Waiting", f"{cause[0]}: {message}")

    def _condition_events(
        self, body: Mapping[str, Any], previous: Mapping[str, Any], status: Mapping[str, Any]
    ) -> None:
        """A Warning Event when a condition takes a reason a user must hear about."""
        before = {c.get("type"): c.get("reason") for c in previous.get("conditions") or ()}
        for c in status.get("conditions") or ():
            reason = c.get("reason")
            if reason in _WARN_REASONS and before.get(c.get("type")) != reason:
                if reason in ("WorkerExited", "SleepRefused", "WakeRefused"):
                    continue  # the round's own Events already say it
                self.emit(body, str(reason), str(c.get("message", "")), warning=True)

    async def _patch_status(
        self, namespace: str, name: str, status: dict[str, Any],
        after: asyncio.Future[None] | None = None,
    ) -> None:  # fmt: skip
        """Write ``status`` (once ``after``, an earlier write of the same stage, is answered)."""
        if after is not None:
            await asyncio.wait([after])  # its errors are its own
        try:
            await self.kube.merge_patch(
                OMNISTAGE, namespace, name, {"status": status}, status=True, answer=False
            )
        except KubeError as exc:
            self.published.pop((namespace, name), None)
            log.warning("status of %s/%s not written: %s", namespace, name, exc)


def _same(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None) -> bool:
    """Equal ignoring condition transition times' formatting noise (None-safe)."""
    return a == b


def _asked_at(asked: float | None, port: RoundView, name: str) -> float | None:
    """``status.requestedActiveAt``: the manual ask, or the held requests' oldest hold."""
    if port.specs[name].wants_active:
        return asked
    if name in port.demand.demand_asks:
        intent = port.demand.intents.get(name)
        return intent.requested_active_at if intent is not None else None
    return None
