"""Serialized hand-over loops per colocation group (``GroupRunner``), and what must survive
between rounds: asks, learned needs, pending fences, crash back-offs, worker channels, the
namespace's worker-token Secret.

``kick`` marks a group dirty and its loop runs rounds until nothing new was asked (kicks during a
round coalesce into one more round). A round runs only while this operator leads; it builds a
``port.KubeGroupPort``, runs ``handover.rounds.run_round`` against it and publishes the stages'
status.

Its halves live apart: the loops (``group_loops``), what a round taught (``round_memory``), the
group claim (``group_claims``), status and Events (``publisher``).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Mapping
from typing import Any

from omnistage_operator.api.spec import SpecError, StageSpec
from omnistage_operator.api.spec_parse import parse_stage
from omnistage_operator.decisions.arbiter import Decision, WorkerPhase
from omnistage_operator.decisions.facts import AckFacts
from omnistage_operator.decisions.handover import FenceFailed, RoundOutcome, RoundPolicy
from omnistage_operator.decisions.handover.rounds import run_round
from omnistage_operator.decisions.handover.sleep_tasks import SleepTracker
from omnistage_operator.decisions.leadership import (
    AllNamespaces,
    Leadership,
    LeadershipLost,
    NamespaceClaims,
    SoleWriter,
)
from omnistage_operator.decisions.peaks import StagePeaks
from omnistage_operator.decisions.pods import TERMINAL_PHASES, CrashBackoff
from omnistage_operator.decisions.readings import KeptReadings
from omnistage_operator.decisions.wake_backoff import WakeBackoff
from omnistage_operator.k8s import metrics
from omnistage_operator.k8s.builders import claim_name, service_name
from omnistage_operator.k8s.group_claims import GroupClaims
from omnistage_operator.k8s.kube import (
    CLAIMS,
    EVENT_CONCURRENCY,
    OMNISTAGE,
    PODS,
    SECRETS,
    SERVICES,
    Kube,
    KubeError,
    tallied,
)
from omnistage_operator.k8s.pod_hash import PodProfile
from omnistage_operator.k8s.port import KubeGroupPort
from omnistage_operator.k8s.settings import Settings
from omnistage_operator.k8s.token_secret import build_token_secret
from omnistage_operator.k8s.views import GroupViews, group_of
from omnistage_operator.k8s.worker_channels import WorkerChannels
from omnistage_operator.k8s.worker_client import WorkerClient
from omnistage_operator.runtime import stage_metrics
from omnistage_operator.runtime.claim_gate import ClaimGate
from omnistage_operator.runtime.demand_watch import DemandWatcher
from omnistage_operator.runtime.event_lane import EventLane
from omnistage_operator.runtime.group_forget import Forgetting
from omnistage_operator.runtime.group_loops import GroupLoops, _Loop
from omnistage_operator.runtime.pipeline_status import PipelineStatus, after_group_round
from omnistage_operator.runtime.publisher import StatusPublisher
from omnistage_operator.runtime.round_memory import RoundMemory

__all__ = ["GroupRunner"]

log = logging.getLogger(__name__)

GroupKey = tuple[str, str]  # (namespace, group)
StageKey = tuple[str, str]  # (namespace, stage)
_TERMINAL = TERMINAL_PHASES
_BUSY = frozenset(
    {
        WorkerPhase.STARTING,
        WorkerPhase.LOADING,
        WorkerPhase.SLEEPING,
        WorkerPhase.WAKING,
        WorkerPhase.UNREACHABLE,
    }
)


class GroupRunner(StatusPublisher, Forgetting, GroupLoops, RoundMemory, GroupClaims, ClaimGate):
    """Serialized hand-over loops per group, plus what must survive between rounds."""

    def __init__(
        self,
        kube: Kube,
        settings: Settings,
        leadership: Leadership | None = None,
        views: GroupViews | None = None,
        claims: NamespaceClaims | None = None,
    ) -> None:
        """``leadership``: who may order workers (``SoleWriter`` without election); a round
        runs only while it leads, and every order carries its epoch. ``views``: the groups'
        stages and pods as the watches saw them (kopf's indexes). ``claims``: the namespaces
        this shard holds (``AllNamespaces`` without election); a round runs only in those."""
        self.kube = kube
        self.views = views if views is not None else GroupViews({}, {})
        self.settings = settings
        self.leadership: Leadership = leadership if leadership is not None else SoleWriter()
        self.claims: NamespaceClaims = claims if claims is not None else AllNamespaces()
        self.claim_waits: dict[StageKey, str] = {}  # the other shard's holder, as told
        self.claim_epochs: dict[str, int] = {}
        self.policy = RoundPolicy(
            ack_retries=settings.ack_retries,
            backoff_s=settings.retry_backoff_s,
            margin_bytes=settings.wake_margin_bytes,
            retry_window_s=settings.sleep_timeout_s,
            transition_allowance_s=settings.sleep_timeout_s,
            round_wait_s=settings.round_wait_s,
            overlapped=settings.overlapped_handover,
        )
        self.asks: dict[StageKey, float] = {}
        self.created: dict[StageKey, str] = {}  # the uid of the stage's pod this process created
        self.reached: dict[StageKey, str] = {}  # ... of its pod whose worker answered
        self.last_acks: dict[StageKey, AckFacts] = {}
        self.fenced: dict[StageKey, str] = {}
        self.auth_errors: dict[StageKey, str] = {}  # workers that refused the operator's token
        self.fence_pending: dict[StageKey, str] = {}  # fences started, pod not confirmed gone
        self.fences_cleared: set[StageKey] = set()  # confirmed by this process (status may lag)
        self.learned: dict[StageKey, int] = {}  # needs learned from refused wakes (0: forgotten)
        self.peaks: dict[StageKey, StagePeaks] = {}  # per-device peaks (status.memory.peak)
        self.backoffs: dict[StageKey, CrashBackoff] = {}
        self.wake_backoffs: dict[StageKey, WakeBackoff] = {}  # after wakes out of memory
        self.device_mismatch: dict[StageKey, str] = {}  # workers with another device count
        # spec.state as last seen (wants Active?), and when it turned Asleep (an OnDemand
        # stage patched Asleep sleeps now, not when idle).
        self.spec_active: dict[StageKey, bool] = {}
        # A 1->2 deepening the worker refused (its backend cannot without waking): the level
        # refused; not ordered again until spec.sleepLevel changes or the stage wakes.
        self.deepen_refused: dict[StageKey, int] = {}
        self.asleep_asked: dict[StageKey, float] = {}
        # Patched Asleep before this process saw the stage wake (read back from status): put
        # to sleep whenever this process saw it become Active.
        self.asleep_restored: set[StageKey] = set()
        self.adopted: set[StageKey] = set()  # stages whose status this process has read back
        self.active_since: dict[StageKey, tuple[str, float]] = {}  # (pod uid, first seen Active)
        self.sleep_problems: dict[StageKey, tuple[str, str]] = {}
        self.wake_problems: dict[StageKey, tuple[str, str]] = {}
        # Component sleeps and wakes that did not go through (reason, message), and the spec's
        # asleepComponents a worker refused (not ordered again until the spec changes).
        self.component_problems: dict[StageKey, tuple[str, str]] = {}
        self.component_refused: dict[StageKey, tuple[str, ...]] = {}
        self.stage_problems: dict[StageKey, tuple[str, str]] = {}  # per-stage round errors
        # claim key: (uid, uuids, the scheduled pods' uids when read)
        self._claims: dict[str, tuple[str, tuple[str, ...], frozenset[str]]] = {}
        self._claim_errors: set[str] = set()
        self._retry_in: dict[GroupKey, float] = {}
        self.published: dict[StageKey, dict[str, Any]] = {}
        self.written_at: dict[StageKey, float] = {}  # when its ``published`` was written
        # Each group's readings at the end of its last round (``readings.KeptReadings``).
        self.kept: dict[GroupKey, KeptReadings] = {}
        self._loops: dict[GroupKey, _Loop] = {}
        self._in_round = 0
        # Per group: its sleeps in flight across rounds (a drain holds up no other transition).
        self._sleeps: dict[GroupKey, SleepTracker] = {}
        self._members: dict[GroupKey, dict[str, str]] = {}  # stages listed: name -> uid
        # one per stage, closed when its pod is replaced or the stage deleted
        self.channels: WorkerChannels[WorkerClient] = WorkerChannels()
        self._secrets: set[str] = set()
        # Events wait for a moment no round runs (``event_lane``), a few in flight at once.
        self.event_lane = EventLane(lambda: self._in_round == 0, concurrency=EVENT_CONCURRENCY)
        self._ids = itertools.count(1)
        self.credentials = settings.worker_credentials()
        self._token = self.credentials.shared
        # What every worker pod is built with: a change of either replaces the pods.
        self.pod_profile = PodProfile(
            settings.log_format, self.credentials.pod_flags(), settings.handoff_host_path
        )
        # OnDemand stages: one demand stream per worker, each change kicks the group.
        self.demand = DemandWatcher(lambda ns, g: self.kick(ns, g, "demand"), self.epoch_for)
        self.pipeline_status = PipelineStatus(kube, self.emit)
        self.count_entries()
        ca = settings.worker_tls_ca
        self._ca: bytes | None = None
        if ca:
            with open(ca, "rb") as f:
                self._ca = f.read()

    # -- plumbing --------------------------------------------------------------------------

    def may_order(self, namespace: str) -> bool:
        """This operator leads and its shard holds the namespace's claim."""
        return self.leadership.leading() and self.claims.held(namespace)

    def epoch_for(self, namespace: str) -> int:
        """The epoch orders carry in ``namespace`` (the shard's, above it the claim's)."""
        return self.claims.epoch(namespace, self.leadership.epoch)

    def new_id(self) -> str:
        """A hand-over id unique to this process and time."""
        return f"h{int(time.time() * 1000):x}-{next(self._ids)}"

    def client_for(
        self, namespace: str, spec: StageSpec, pod: Mapping[str, Any]
    ) -> WorkerClient | None:
        """The channel to a pod's worker (None while it has no address); the channel to the
        stage's previous pod is closed."""
        ip = (pod.get("status") or {}).get("podIP")
        if not ip or (pod.get("status") or {}).get("phase") in _TERMINAL:
            return None
        host = f"[{ip}]" if ":" in ip else ip
        target = f"{host}:{spec.worker.port}"
        tls = spec.worker.tls.enabled  # spec.worker.tls: TLS, verified with --worker-tls-ca
        name = f"{service_name(spec.name)}.{namespace}.svc"  # what a worker certificate names
        return self.channels.get(
            (namespace, spec.name),
            str((pod.get("metadata") or {}).get("uid") or ""),
            f"{target}+tls" if tls else target,
            lambda: WorkerClient(
                target,
                token=self.credentials.current,
                ca_pem=self._ca if tls else None,
                server_name=name,
                tls=tls,
            ),
        )

    async def fence_started(self, namespace: str, name: str, reason: str) -> None:
        """Record a fence before its delete: in memory and in ``status.fencePending`` (raises
        ``FenceFailed`` when the status cannot be written: no delete goes out unrecorded)."""
        key = (namespace, name)
        self.fence_pending[key] = reason
        self.fences_cleared.discard(key)
        self.published.pop(key, None)
        patch = {"status": {"fencePending": reason}}
        try:
            await self.kube.merge_patch(OMNISTAGE, namespace, name, patch, status=True)
        except KubeError as exc:
            raise FenceFailed(f"fence of {name} not recorded in status: {exc}") from exc

    def fence_confirmed(
        self, namespace: str, name: str, body: Mapping[str, Any] | None = None
    ) -> None:
        """The API confirmed the fenced pod gone: clear the pending fence in memory (the gate
        opens at once). Its status is cleared by the stage's next write, with the fence's
        outcome: the round that confirmed it writes the stage (its checkpoint, else its publish:
        ``published`` is dropped, so the write goes out), not a write of its own. Until then the
        status still says pending: a process that takes over reads it, finds the pod gone and
        confirms again."""
        key = (namespace, name)
        was = self.fence_pending.pop(key, None)
        self.fences_cleared.add(key)
        self.published.pop(key, None)
        if was is not None and body is not None:
            self.emit(body, "FenceConfirmed", f"pod confirmed gone; fence done: {was}")

    def worker_exited(
        self, body: Mapping[str, Any], uid: str, message: str, now: float, spec_hash: str = ""
    ) -> None:
        """Count a worker's exit (once per pod) into its stage's back-off, with an Event;
        ``spec_hash``: the digest of the pod spec it was counted under."""
        meta = body["metadata"]
        key = (meta.get("namespace") or "default", meta["name"])
        before = self.backoffs.get(key, CrashBackoff())
        after = before.exited(uid, message, now, spec_hash)
        if after is before:
            return
        self.backoffs[key] = after
        self.emit(
            body,
            "WorkerExited",
            f"{message} (exit {after.restarts}; next pod in {after.delay_s():.0f}s)",
            warning=True,
        )

    async def delete_pod(
        self, namespace: str, pod: Mapping[str, Any], *, grace_s: int | None = None
    ) -> bool:
        """Delete a worker pod and wait until the API confirms it gone (False on timeout);
        a confirmed pod is hidden from the views at once."""
        meta = pod["metadata"]
        gone = await self.kube.delete_confirmed(
            PODS, namespace, meta["name"], meta["uid"],
            timeout_s=self.settings.fence_timeout_s, grace_s=grace_s,
        )  # fmt: skip
        if gone:
            self.views.gone(meta["uid"])
        return gone

    async def ensure_secret(self, namespace: str) -> None:
        """Copy the worker token into the namespace's Secret (once per process)."""
        if namespace in self._secrets or self._token is None:
            return
        manifest = build_token_secret(namespace, self._token)
        if not await self.kube.create(SECRETS, namespace, manifest):
            await self.kube.merge_patch(SECRETS, namespace, manifest["metadata"]["name"], manifest)
        self._secrets.add(namespace)

    async def close(self) -> None:
        """Stop the loops and demand streams, and close the worker channels."""
        for loop in self._loops.values():
            if loop.task is not None:
                loop.task.cancel()
        for tracker in self._sleeps.values():
            tracker.cancel()
        await self.demand.close()
        await self.channels.close()
        await self.event_lane.close()

    # -- loops -----------------------------------------------------------------------------

    def record_ask(self, namespace: str, name: str, when: float | None = None) -> None:
        """The stage just asked for Active (arbiter order: the most recent ask first)."""
        self.asks[(namespace, name)] = time.time() if when is None else when

    async def round(self, namespace: str, group: str) -> bool:
        """One round; True when something is still in progress (poll again soon).

        Runs only while this operator leads and its shard holds the namespace's claim
        (``claim_gate``); leadership (or the claim) lost in the middle ends the round
        (``LeadershipLost`` from the port) with nothing more ordered or published: the new
        leader's first round reads every worker's real state."""
        if not self.leadership.leading():
            log.debug("group %s/%s: not leading, no round", namespace, group)
            return False
        if not await self.claim_gate(namespace, group):  # another shard's namespace
            return False
        requests = metrics.ROUND_API_REQUESTS.labels(namespace, group)
        objects = metrics.ROUND_API_OBJECTS.labels(namespace, group)

        def counted(n: int, read: int) -> None:  # as each request ends (late Events too)
            requests.inc(n)
            objects.inc(read)

        self.demand.round_began(namespace, group)
        try:
            with tallied(counted):
                return await self._round(namespace, group)
        finally:  # a demand report that came meanwhile kicks again only with news
            self.demand.round_ended(namespace, group)

    async def _round(self, namespace: str, group: str) -> bool:
        # The group's last readings: this round's first plan may send its sleeps from them.
        self.forget_left(namespace, group)  # stages gone (or re-created) since its last round
        port = KubeGroupPort(self, namespace, group, self.kept.pop((namespace, group), None))
        try:
            return await self._round_of(port, namespace, group)
        finally:  # every write of an ended round is answered
            await port.checkpoint_written()
            invalid = [body for body, _ in port.invalid.values()]
            self.listed(namespace, group, [*port.bodies.values(), *invalid])

    async def _round_of(self, port: KubeGroupPort, namespace: str, group: str) -> bool:
        t0 = time.monotonic()
        tracker = self._sleeps.get((namespace, group))
        if tracker is None:
            tracker = SleepTracker(lambda: self.kick(namespace, group, "sleep"))
            self._sleeps[(namespace, group)] = tracker
        try:
            outcome = await run_round(port, self.policy, self.new_id, tracker)
        except LeadershipLost as exc:
            log.warning("group %s/%s: round ended: %s", namespace, group, exc)
            metrics.ROUNDS.labels(namespace, group, "leadership_lost").inc()
            return False
        if outcome.sleeps or outcome.wakes:
            took = time.monotonic() - min(t0, outcome.handover_began or t0)
            metrics.HANDOVER_SECONDS.labels(namespace, group).observe(took)
            log.info(
                "group %s/%s hand-over %s: slept %s, woke %s in %.3fs",
                namespace, group, outcome.handover_id,
                [s.order.stage for s in outcome.sleeps], list(outcome.wakes), took,
                extra=_handover_fields(namespace, group, outcome, self.epoch_for(namespace)),
            )  # fmt: skip
        if _orders(outcome.decision):
            self.demand.round_ordered(namespace, group)
        kept = port.kept_readings()
        if kept is not None:
            self.kept[(namespace, group)] = kept
        metrics.ROUNDS.labels(namespace, group, "acted" if outcome.changed else "idle").inc()
        stage_metrics.record_round(namespace, group, outcome)
        self._remember(namespace, outcome)
        self._note_wake_oom(port, outcome)
        waits = [*port.held_back.values(), *port.wake_held.values()]
        if waits:
            self._retry_in[(namespace, group)] = min(waits)
        if not self.may_order(namespace):  # lost while the round ran: the new leader writes
            log.warning("group %s/%s: leadership lost; status not written", namespace, group)
            return False
        await self.publish(port, outcome)
        await after_group_round(self, port, outcome)
        facts = port.facts.values()
        return (
            any(f.phase in _BUSY for f in facts)
            or bool(outcome.wake_errors)
            or any(not s.ok and not s.fenced for s in outcome.sleeps)
            or bool(outcome.stage_errors)
        )

    async def cleanup_stage(self, body: Mapping[str, Any]) -> None:
        """Delete a stage's pod (until confirmed gone), Service, and the claim of an empty group."""
        ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
        try:
            spec: StageSpec | None = parse_stage(body)
        except SpecError:
            spec = None
        pod_name = f"{name}-worker"
        self.demand.drop(ns, name)  # its open stream would hold the pod's termination
        pod = await self.kube.get(PODS, ns, pod_name)
        if pod is not None and not await self.delete_pod(ns, pod):
            raise FenceFailed(f"pod {pod_name} not confirmed gone")
        await self.kube.delete(SERVICES, ns, f"{name}-worker")
        group = group_of(body)
        if group is not None and (spec is None or self.claim_for(spec) is not None):
            others = [
                b
                for b in self.views.stages(ns, group)
                if b["metadata"]["name"] != name and not b["metadata"].get("deletionTimestamp")
            ]
            if not others:
                await self.kube.delete(CLAIMS, ns, claim_name(group))
                log.info("%s: group %s empty, claim deleted", ns, group)
        self.forget(ns, name)


def _orders(decision: Decision | None) -> bool:
    """The plan orders something (its round acts on every plan but its last)."""
    if decision is None:
        return False
    return bool(
        decision.sleep or decision.wake or decision.fence or decision.component_wakes
    )  # fmt: skip


def _handover_fields(
    namespace: str, group: str, outcome: RoundOutcome, epoch: int
) -> dict[str, object]:
    """The structured fields of a hand-over's log line (JSON logs)."""
    return {
        "namespace": namespace,
        "group": group,
        "handover_id": outcome.handover_id,
        "epoch": epoch,
        "slept": [s.order.stage for s in outcome.sleeps],
        "task_ids": [t for s in outcome.sleeps for t in s.task_ids],
        "woke": list(outcome.wakes),
    }
