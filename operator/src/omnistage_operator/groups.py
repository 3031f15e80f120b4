"""Runs hand-over rounds per colocation group against Kubernetes and the real workers.

``GroupRunner`` keeps one serialized loop per ``(namespace, group)``: ``kick`` marks the group
dirty and the loop runs rounds until nothing new was asked (kicks during a round coalesce into
one more round). ``KubeGroupPort`` implements ``handover.GroupPort``: it reads specs and pods
from the API server and every worker's GetStatus, creates children, calls Sleep/WakeUp with
deadlines and fences pods. After each round the stages' status is patched from the facts.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from omnistage_operator import conditions as cond
from omnistage_operator import metrics
from omnistage_operator.arbiter import (
    StageFacts,
    StageIntent,
    WorkerPhase,
)
from omnistage_operator.builders import (
    POD_SPEC_HASH_ANNOTATION,
    build_group_claim,
    build_service,
    build_token_secret,
    build_worker_pod,
    claim_name,
    owner_reference,
    pod_claim_name,
    pod_spec_hash,
    service_name,
)
from omnistage_operator.facts import AckFacts, WorkerReport
from omnistage_operator.handover import (
    FenceFailed,
    GroupObservation,
    RoundOutcome,
    RoundPolicy,
    WorkerRefused,
    WorkerUnauthenticated,
    WorkerUnavailable,
    run_round,
)
from omnistage_operator.kube import (
    CLAIMS,
    OMNISTAGE,
    PODS,
    RESOURCE_SLICES,
    SECRETS,
    SERVICES,
    Kube,
    KubeError,
)
from omnistage_operator.labels import (
    GROUP_LABEL,
    MANAGED_BY_LABEL,
    MANAGER,
    STAGE_LABEL,
    selector_string,
)
from omnistage_operator.leadership import Leadership, LeadershipLost, SoleWriter
from omnistage_operator.memory import group_memory
from omnistage_operator.pods import (
    RESET_AFTER_S,
    TERMINAL_PHASES,
    CrashBackoff,
    claim_device_uuids,
    container_started,
    exit_message,
)
from omnistage_operator.quantities import format_bytes
from omnistage_operator.settings import Settings
from omnistage_operator.spec import DesiredState, PlacementMode, SpecError, StageSpec, parse_stage
from omnistage_operator.status import (
    StageObservation,
    build_status,
    format_timestamp,
    parse_timestamp,
    persisted_facts,
)
from omnistage_operator.worker_client import WorkerClient

__all__ = ["GroupRunner", "KubeGroupPort"]

log = logging.getLogger(__name__)

GroupKey = tuple[str, str]  # (namespace, group)
StageKey = tuple[str, str]  # (namespace, stage)
_TERMINAL = TERMINAL_PHASES
_NOT_LOADED = frozenset({WorkerPhase.ABSENT, WorkerPhase.STARTING, WorkerPhase.LOADING})
# Condition reasons that are news for a user: an Event (Warning) when a condition takes one.
_WARN_REASONS = frozenset(
    {
        cond.Reason.LARGER_THAN_DEVICE,
        cond.Reason.DEVICE_MISMATCH,
        cond.Reason.ACK_CONTRADICTED,
        cond.Reason.FENCE_PENDING,
        cond.Reason.WORKER_FAILED,
        cond.Reason.SLEEP_REFUSED,
        cond.Reason.WAKE_REFUSED,
        "WorkerExited",
    }
)
_BUSY = frozenset(
    {
        WorkerPhase.STARTING,
        WorkerPhase.LOADING,
        WorkerPhase.SLEEPING,
        WorkerPhase.WAKING,
        WorkerPhase.UNREACHABLE,
    }
)


def group_of(body: Mapping[str, Any]) -> str | None:
    """``spec.colocation.group`` of a raw body, if any."""
    spec = body.get("spec") or {}
    coloc = spec.get("colocation") or {}
    group = coloc.get("group")
    return group if isinstance(group, str) else None


@dataclass
class _Loop:
    dirty: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    followup: asyncio.TimerHandle | None = None
    backoff_s: float = 0.2


class KubeGroupPort:
    """``GroupPort`` of one group, for one round."""

    def __init__(self, runner: GroupRunner, namespace: str, group: str) -> None:
        self.r = runner
        self.ns = namespace
        self.group = group
        self.specs: dict[str, StageSpec] = {}
        self.bodies: dict[str, dict[str, Any]] = {}
        self.pods: dict[str, dict[str, Any]] = {}
        self.reports: dict[str, WorkerReport] = {}
        self.facts: dict[str, StageFacts] = {}
        self.invalid: dict[str, tuple[dict[str, Any], SpecError]] = {}
        self.held_back: dict[str, float] = {}  # stages in crash back-off: seconds left
        self._listed = False

    # -- observing -------------------------------------------------------------------------

    def _intent(self, spec: StageSpec, body: Mapping[str, Any], fact: StageFacts) -> StageIntent:
        """The arbiter's view of a spec. A stage whose worker has not loaded yet (no pod, pod
        starting, worker loading) does not ask for memory yet: it could not be woken anyway,
        and a worker that never loads (a wrong model path) must not put the group's healthy
        stages to sleep. Its ask time is kept, so it takes its turn once loaded."""
        deleting = bool(body["metadata"].get("deletionTimestamp"))
        want = spec.wants_active and not deleting
        ready = fact.phase not in _NOT_LOADED
        key = (self.ns, spec.name)
        asked = self.r.asks.get(key)
        if want and asked is None:
            status = body.get("status") or {}
            created = parse_timestamp(body["metadata"].get("creationTimestamp"))
            asked = parse_timestamp(status.get("requestedActiveAt")) or created or time.time()
            self.r.asks[key] = asked
        return StageIntent(
            name=spec.name,
            want_active=want and ready,
            priority=spec.priority,
            requested_active_at=asked or 0.0 if want else 0.0,
            sleep_level=spec.sleep_level,
            vram_request=spec.vram_request_bytes,
            gpus=spec.gpus,
            drain_timeout_s=float(spec.drain_timeout_s),
        )

    async def _status_of(self, name: str, pod: Mapping[str, Any]) -> WorkerReport | None:
        client = self.r.client_for(self.ns, self.specs[name], pod)
        if client is None:
            return None
        key = (self.ns, name)
        try:
            report = await client.get_status(self.r.settings.status_timeout_s)
        except WorkerUnauthenticated as exc:
            if self.r.auth_errors.get(key) != str(exc):
                log.warning("%s/%s: %s", self.ns, name, exc)
                self.r.emit(self.bodies[name], "WorkerUnauthenticated", str(exc), warning=True)
            self.r.auth_errors[key] = str(exc)
            return None
        except (WorkerUnavailable, WorkerRefused) as exc:
            log.debug("GetStatus %s/%s: %s", self.ns, name, exc)
            return None
        self.r.auth_errors.pop(key, None)
        return report

    def _facts(
        self, name: str, pod: Mapping[str, Any] | None, rep: WorkerReport | None
    ) -> StageFacts:
        if pod is None:
            return StageFacts(WorkerPhase.ABSENT)
        key = (self.ns, name)
        learned = self.r.learned.get(key) or None
        uid = pod["metadata"]["uid"]
        phase = (pod.get("status") or {}).get("phase", "Pending")
        if (pod["metadata"].get("labels") or {}).get(GROUP_LABEL) != self.group:
            # A pod of another group (the CRD makes the group immutable, so only a pod left
            # from a deleted and re-created stage): its memory is on that group's devices; it
            # is deleted (confirmed) before this group's pod is created.
            return StageFacts(WorkerPhase.ABSENT)
        if key in self.r.fence_pending:
            # A fence was started and the API has not confirmed the pod gone: whatever the
            # pod or its worker says, it may hold memory, and the gate stays closed.
            if rep is not None:
                return rep.stage_facts(fence_pending=True, learned_need=learned)
            return StageFacts(WorkerPhase.UNREACHABLE, fence_pending=True, learned_need=learned)
        if phase in _TERMINAL:
            return StageFacts(WorkerPhase.ABSENT)  # the kubelet reported its containers ended
        if rep is not None:
            self.r.reached.add(uid)
            return rep.stage_facts(learned_need=learned)
        if phase == "Pending" and not container_started(pod):
            return StageFacts(WorkerPhase.STARTING)
        if uid in self.r.created and uid not in self.r.reached:
            return StageFacts(WorkerPhase.STARTING)
        return StageFacts(WorkerPhase.UNREACHABLE)

    async def observe(self) -> GroupObservation:
        """Read the group's specs, pods and every worker's GetStatus.

        Within one round, specs and pods are listed again only after this port created or
        deleted a pod; otherwise only the workers are asked again (a spec changed meanwhile
        kicks another round).
        """
        if not self._listed:
            await self._list()
            self._listed = True
        names = sorted(self.specs)
        await self._adopt_persisted(names)
        with_pod = [
            n
            for n in names
            if n in self.pods
            and (self.pods[n]["metadata"].get("labels") or {}).get(GROUP_LABEL) == self.group
        ]
        reports = await asyncio.gather(*(self._status_of(n, self.pods[n]) for n in with_pod))
        self.reports = {n: rep for n, rep in zip(with_pod, reports, strict=True) if rep}
        self.facts = {n: self._facts(n, self.pods.get(n), self.reports.get(n)) for n in names}
        self._note_exits(names)
        # A stage in crash back-off holds nothing (its container ended) and is left out of the
        # arbitration until the back-off ends: it is neither admitted nor started, so the
        # group's healthy stages are not put to sleep for it.
        arbitrated = [n for n in names if n not in self.held_back]
        claim_uuids = await self.r.claim_uuids(self.ns, self.group, self.specs)
        memory = group_memory(
            {n: r for n, r in self.reports.items() if n in arbitrated},
            {n: self.specs[n].gpus for n in arbitrated},
            claim_uuids,
        )
        intents = {
            n: self._intent(self.specs[n], self.bodies[n], self.facts[n]) for n in arbitrated
        }
        facts = {n: self.facts[n] for n in arbitrated}
        return GroupObservation(intents, facts, memory)

    async def _adopt_persisted(self, names: list[str]) -> None:
        """Facts a previous operator process persisted in status (a pending fence, a learned
        need) come back; a pending fence whose pod the API no longer lists is confirmed."""
        for name in names:
            key = (self.ns, name)
            persisted = persisted_facts(self.bodies[name].get("status"))
            if (
                persisted.fence_pending
                and key not in self.r.fence_pending
                and key not in self.r.fences_cleared
            ):
                reason = persisted.fence_reason or "fence pending (persisted)"
                self.r.fence_pending[key] = reason
            if persisted.learned_need is not None and key not in self.r.learned:
                self.r.learned[key] = persisted.learned_need
            if key in self.r.fence_pending and name not in self.pods:
                await self.r.fence_confirmed(self.ns, name, self.bodies[name])

    def _note_exits(self, names: list[str]) -> None:
        """Count exited worker containers into each stage's back-off; reset the back-off of a
        stage whose pod has run Active long enough."""
        now = time.time()
        self.held_back.clear()
        for name in names:
            key = (self.ns, name)
            pod = self.pods.get(name)
            fact = self.facts[name]
            if pod is not None and fact.phase is WorkerPhase.ACTIVE:
                uid = pod["metadata"]["uid"]
                since = self.r.active_since.get(key)
                if since is None or since[0] != uid:
                    self.r.active_since[key] = (uid, now)
                elif now - since[1] >= RESET_AFTER_S and key in self.r.backoffs:
                    del self.r.backoffs[key]
            phase = (pod.get("status") or {}).get("phase") if pod is not None else None
            if (
                pod is not None
                and phase in _TERMINAL
                and not pod["metadata"].get("deletionTimestamp")  # deleted on purpose: no crash
                and key not in self.r.fence_pending
                and (pod["metadata"].get("labels") or {}).get(GROUP_LABEL) == self.group
            ):
                message = exit_message(pod) or "worker container ended"
                self.r.worker_exited(self.bodies[name], pod["metadata"]["uid"], message, now)
            backoff = self.r.backoffs.get(key)
            if backoff is not None and fact.phase is WorkerPhase.ABSENT:
                left = backoff.waiting(now)
                if left > 0:
                    self.held_back[name] = left

    async def _list(self) -> None:
        await self.r.ensure_secret(self.ns)  # also repairs a Secret left from another token
        stages, pods = await asyncio.gather(
            self.r.kube.list(OMNISTAGE, self.ns),
            self.r.kube.list(PODS, self.ns, selector_string({MANAGED_BY_LABEL: MANAGER})),
        )
        bodies = [b for b in stages if group_of(b) == self.group]
        self.specs.clear()
        self.bodies.clear()
        for body in bodies:
            try:
                spec = parse_stage(body)
            except SpecError as exc:
                self.invalid[body["metadata"]["name"]] = (body, exc)
                continue
            self.specs[spec.name] = spec
            self.bodies[spec.name] = body
        self.pods = {
            p["metadata"]["labels"][STAGE_LABEL]: p
            for p in pods
            if p["metadata"].get("labels", {}).get(STAGE_LABEL) in self.specs
        }
        orphans = [
            p
            for p in pods
            if p["metadata"].get("labels", {}).get(GROUP_LABEL) == self.group
            and p["metadata"].get("labels", {}).get(STAGE_LABEL) not in self.specs
            and (p.get("status") or {}).get("phase") not in _TERMINAL
        ]
        for pod in orphans:
            await self._fence_orphan(pod, {b["metadata"]["name"]: b for b in stages})
        for name, pod in list(self.pods.items()):
            if _outdated(pod, self.specs[name]):
                await self._replace_outdated(name, pod)
                del self.pods[name]

    async def _replace_outdated(self, stage: str, pod: Mapping[str, Any]) -> None:
        """The stage's spec changed in a field its pod was built from (image, model, template,
        ...): delete the pod with its grace period (in-flight requests finish) and wait until
        the API server confirms it is gone, so its process, and the device memory it held, are
        gone before the round creates the new pod, asleep, behind the usual ACK gate."""
        meta = pod["metadata"]
        body = self.bodies[stage]
        self._ensure_leading(f"replacement of {meta['name']}")
        self.r.emit(body, "PodOutdated", f"pod {meta['name']} predates the spec; replacing it")
        # What was learned about the old pod (its need, its crashes) is about the old spec.
        self.r.learned[(self.ns, stage)] = 0
        self.r.backoffs.pop((self.ns, stage), None)
        await self._delete_confirmed(pod, f"outdated pod {meta['name']} not confirmed gone")
        self.r.emit(body, "PodReplaced", f"outdated pod {meta['name']} deleted and confirmed gone")

    async def _fence_orphan(
        self, pod: Mapping[str, Any], stages: Mapping[str, Mapping[str, Any]]
    ) -> None:
        """A pod labelled with this group whose stage is no longer arbitrated here (its spec
        became invalid, or it was re-created in another group) may hold this group's memory:
        delete it and wait until the API server confirms it is gone."""
        meta = pod["metadata"]
        stage = meta.get("labels", {}).get(STAGE_LABEL, "")
        body = stages.get(stage)
        reason = f"pod {meta['name']} belongs to group {self.group} but its stage left the group"
        if body is not None:
            self.r.emit(body, "Fencing", reason, warning=True)
        await self._delete_confirmed(pod, f"pod {meta['name']} not confirmed gone", grace_s=5)
        metrics.FENCES.labels(self.ns, self.group, "fenced").inc()
        if body is not None:
            self.r.emit(body, "Fenced", f"{reason}; deleted and confirmed gone", warning=True)

    async def _delete_confirmed(
        self,
        pod: Mapping[str, Any],
        failure: str,
        *,
        grace_s: int | None = None,
        count_timeout: bool = True,
    ) -> None:
        """Delete ``pod`` and wait until the API server confirms it is gone; raise
        ``FenceFailed(failure)`` (counted as a fence timeout) when it is not within the fence
        timeout."""
        meta = pod["metadata"]
        await self.r.kube.delete(PODS, self.ns, meta["name"], uid=meta["uid"], grace_s=grace_s)
        if not await self.r.kube.wait_gone(
            PODS, self.ns, meta["name"], meta["uid"], self.r.settings.fence_timeout_s
        ):
            if count_timeout:
                metrics.FENCES.labels(self.ns, self.group, "timeout").inc()
            raise FenceFailed(failure)

    # -- acting ----------------------------------------------------------------------------

    async def start(self, stage: str) -> None:
        """Create the stage's token Secret, group claim, Pod (asleep) and Service."""
        spec, body = self.specs[stage], self.bodies[stage]
        if body["metadata"].get("deletionTimestamp"):
            return
        self._ensure_leading(f"start of {stage}")
        old = self.pods.get(stage)
        if old is not None:  # ended or of another group: delete it, wait until confirmed gone
            await self._delete_confirmed(old, f"old pod of {stage} not gone", count_timeout=False)
        await self.r.ensure_secret(self.ns)
        claim = self.r.claim_for(spec)
        if claim is not None:
            gpus = max(s.gpus for s in self.specs.values())
            manifest = build_group_claim(self.ns, self.group, gpus, self.r.settings.device_class)
            await self.r.kube.create(CLAIMS, self.ns, manifest)
        owner = owner_reference(body)
        pod = build_worker_pod(
            spec, initial_state=DesiredState.ASLEEP, owner=owner, claim_name=claim
        )
        created = await self.r.kube.create_returning(PODS, self.ns, pod)
        if created is not None:
            self.r.created.add(created["metadata"]["uid"])
            log.info("%s/%s: created pod %s (asleep)", self.ns, stage, pod["metadata"]["name"])
        await self.r.kube.create(SERVICES, self.ns, build_service(spec, owner=owner))
        self._listed = False

    def _ensure_leading(self, what: str) -> None:
        """Raise ``LeadershipLost`` unless this operator still leads: an order (Sleep, WakeUp,
        a fence's delete) is never sent by a process that may have been replaced."""
        if not self.r.leadership.leading():
            raise LeadershipLost(f"{what} in group {self.ns}/{self.group}: no longer leading")

    def _client(self, stage: str) -> WorkerClient:
        pod = self.pods.get(stage)
        client = None if pod is None else self.r.client_for(self.ns, self.specs[stage], pod)
        if client is None:
            raise WorkerUnavailable(f"{stage} has no running pod with an address")
        return client

    async def probe(self, stage: str) -> StageFacts:
        """GetStatus of one worker, as the arbiter's facts (a draining sleep is told from a
        lost worker by this)."""
        pod = self.pods.get(stage)
        if pod is None:
            return StageFacts(WorkerPhase.ABSENT)
        rep = await self._status_of(stage, pod)
        if rep is not None:
            self.reports[stage] = rep
        return self._facts(stage, pod, rep)

    async def sleep(
        self,
        stage: str,
        level: int,
        task_id: str,
        *,
        drain_timeout_s: float | None = None,
        timeout_s: float | None = None,
    ) -> AckFacts:
        """Sleep; the request carries the stage's drain timeout, and the call's deadline is
        ``timeout_s`` (the round's: --sleep-timeout, plus the drain timeout while requests are
        in flight), else the drain timeout plus --sleep-timeout. The ACK is kept for status."""
        client = self._client(stage)
        self._ensure_leading(f"Sleep {task_id}")
        drain = (
            float(self.specs[stage].drain_timeout_s) if drain_timeout_s is None else drain_timeout_s
        )
        deadline = timeout_s if timeout_s is not None else drain + self.r.settings.sleep_timeout_s
        t0 = time.monotonic()
        ack = await client.sleep(
            level, task_id, deadline, epoch=self.r.leadership.epoch, drain_timeout_s=drain
        )
        metrics.ACK_SECONDS.labels("sleep").observe(time.monotonic() - t0)
        self.r.last_acks[(self.ns, stage)] = ack
        result = "ok" if ack.ok else "not_ok"
        metrics.TRANSITIONS.labels(self.ns, self.group, "sleep", result).inc()
        if ack.ok and ack.freed_bytes > 0 and not ack.replayed:
            metrics.BYTES_FREED.labels(self.ns, self.group).inc(ack.freed_bytes)
        return ack

    async def wake(self, stage: str, task_id: str) -> AckFacts:
        """WakeUp with the contract's deadline; the ACK is kept for status."""
        client = self._client(stage)
        self._ensure_leading(f"WakeUp {task_id}")
        t0 = time.monotonic()
        ack = await client.wake(
            task_id, self.r.settings.wake_timeout_s, epoch=self.r.leadership.epoch
        )
        metrics.ACK_SECONDS.labels("wake").observe(time.monotonic() - t0)
        self.r.last_acks[(self.ns, stage)] = ack
        result = "ok" if ack.ok else "not_ok"
        metrics.TRANSITIONS.labels(self.ns, self.group, "wake", result).inc()
        return ack

    async def checkpoint(self, outcome: RoundOutcome) -> None:
        """Publish the sleeps' ACKs in status before any wake goes out."""
        await self.r.publish(self, outcome, events=False)

    async def fence(self, stage: str, reason: str) -> None:
        """Delete the stage's pod; return only once the API server confirms it is gone."""
        pod = self.pods.get(stage)
        body = self.bodies[stage]
        key = (self.ns, stage)
        self._ensure_leading(f"fence of {stage}")
        # Persisted before the delete: an operator restarted from here on keeps the gate
        # closed until the API confirms the pod gone (status.fencePending).
        await self.r.fence_started(self.ns, stage, reason)
        rep = self.reports.get(stage)
        self.r.emit(body, "Fencing", f"deleting the worker pod: {reason}", warning=True)
        if pod is not None:
            name, uid = pod["metadata"]["name"], pod["metadata"]["uid"]
            await self.r.kube.delete(PODS, self.ns, name, uid=uid, grace_s=5)
            gone = await self.r.kube.wait_gone(
                PODS, self.ns, name, uid, self.r.settings.fence_timeout_s
            )
            if not gone:
                metrics.FENCES.labels(self.ns, self.group, "timeout").inc()
                self.r.emit(body, "FenceFailed", f"pod {name} still exists", warning=True)
                raise FenceFailed(f"pod {name} of {stage} not confirmed gone")
        self._listed = False
        await self.r.fence_confirmed(self.ns, stage, body)
        metrics.FENCES.labels(self.ns, self.group, "fenced").inc()
        self.r.fenced[key] = reason
        self.r.emit(
            body, "Fenced", f"worker pod deleted and confirmed gone: {reason}", warning=True
        )
        if pod is not None and rep is not None and rep.phase is WorkerPhase.FAILED:
            # A worker that failed (at load, or a residual it could not release) is a crash:
            # its stage backs off before a new pod, with the worker's own reason in status.
            why = f"worker failed: {rep.error}" if rep.error else "worker failed"
            self.r.worker_exited(body, pod["metadata"]["uid"], why, time.time())


def _outdated(pod: Mapping[str, Any], spec: StageSpec) -> bool:
    """The pod was built from another version of the fields a pod is made of."""
    if (pod.get("status") or {}).get("phase") in _TERMINAL or pod["metadata"].get(
        "deletionTimestamp"
    ):
        return False  # ended or already going: the round's usual path handles it
    built = (pod["metadata"].get("annotations") or {}).get(POD_SPEC_HASH_ANNOTATION)
    return built is not None and built != pod_spec_hash(spec)


class GroupRunner:
    """Serialized hand-over loops per group, plus what must survive between rounds."""

    def __init__(
        self, kube: Kube, settings: Settings, leadership: Leadership | None = None
    ) -> None:
        """``leadership``: who may order workers (``SoleWriter`` without election); a round
        runs only while it leads, and every order carries its epoch."""
        self.kube = kube
        self.settings = settings
        self.leadership: Leadership = leadership if leadership is not None else SoleWriter()
        self.policy = RoundPolicy(
            ack_retries=settings.ack_retries,
            backoff_s=settings.retry_backoff_s,
            margin_bytes=settings.wake_margin_bytes,
            retry_window_s=settings.sleep_timeout_s,
            transition_allowance_s=settings.sleep_timeout_s,
        )
        self.asks: dict[StageKey, float] = {}
        self.created: set[str] = set()  # pod uids this process created
        self.reached: set[str] = set()  # pod uids whose worker answered
        self.last_acks: dict[StageKey, AckFacts] = {}
        self.fenced: dict[StageKey, str] = {}
        self.auth_errors: dict[StageKey, str] = {}  # workers that refused the operator's token
        self.fence_pending: dict[StageKey, str] = {}  # fences started, pod not confirmed gone
        self.fences_cleared: set[StageKey] = set()  # confirmed by this process (status may lag)
        self.learned: dict[StageKey, int] = {}  # needs learned from refused wakes (0: forgotten)
        self.backoffs: dict[StageKey, CrashBackoff] = {}
        self.active_since: dict[StageKey, tuple[str, float]] = {}  # (pod uid, first seen Active)
        self.sleep_problems: dict[StageKey, tuple[str, str]] = {}
        self.wake_problems: dict[StageKey, tuple[str, str]] = {}
        self._claims: dict[str, tuple[str, tuple[str, ...]]] = {}  # claim key: (uid, uuids)
        self._claim_errors: set[str] = set()
        self._retry_in: dict[GroupKey, float] = {}
        self.published: dict[StageKey, dict[str, Any]] = {}
        self._loops: dict[GroupKey, _Loop] = {}
        self._clients: dict[str, WorkerClient] = {}
        self._secrets: set[str] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._ids = itertools.count(1)
        self._token = settings.worker_token()
        ca = settings.worker_tls_ca
        self._ca: bytes | None = None
        if ca:
            with open(ca, "rb") as f:
                self._ca = f.read()

    # -- plumbing --------------------------------------------------------------------------

    def new_id(self) -> str:
        """A hand-over id unique to this process and time."""
        return f"h{int(time.time() * 1000):x}-{next(self._ids)}"

    def client_for(
        self, namespace: str, spec: StageSpec, pod: Mapping[str, Any]
    ) -> WorkerClient | None:
        """The cached channel to a pod's worker (None while it has no address)."""
        ip = (pod.get("status") or {}).get("podIP")
        if not ip or (pod.get("status") or {}).get("phase") in _TERMINAL:
            return None
        host = f"[{ip}]" if ":" in ip else ip
        target = f"{host}:{spec.worker.port}"
        client = self._clients.get(target)
        if client is None:
            name = f"{service_name(spec.name)}.{namespace}.svc"  # what a worker certificate names
            client = WorkerClient(target, token=self._token, ca_pem=self._ca, server_name=name)
            self._clients[target] = client
        return client

    def claim_for(self, spec: StageSpec) -> str | None:
        """The group claim a stage's pod references (none in explicit placement)."""
        if self.settings.placement == "explicit" or spec.placement.mode is PlacementMode.EXPLICIT:
            return None
        return pod_claim_name(spec)

    async def claim_uuids(
        self, namespace: str, group: str, specs: Mapping[str, StageSpec]
    ) -> tuple[str, ...] | None:
        """GPU UUIDs the group's claim was allocated (from the ResourceSlices' ``uuid``
        attribute), for the device-identity check; None without a claim (Explicit placement:
        the workers are checked against each other), before allocation, or when the API does
        not let this operator read claims and slices (the check is then skipped, logged once)."""
        if not any(self.claim_for(spec) is not None for spec in specs.values()):
            return None
        name = claim_name(group)
        cache_key = f"{namespace}/{name}"
        try:
            claim = await self.kube.get(CLAIMS, namespace, name)
            if claim is None:
                return None
            uid = claim["metadata"].get("uid", "")
            cached = self._claims.get(cache_key)
            if cached is not None and cached[0] == uid:
                return cached[1]  # an allocation does not change while the claim lives
            results = ((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}
            drivers = {r.get("driver") for r in results.get("results") or () if r.get("driver")}
            slices: list[dict[str, Any]] = []
            for driver in sorted(drivers):
                slices += await self.kube.list_cluster(
                    RESOURCE_SLICES, field_selector=f"spec.driver={driver}"
                )
        except KubeError as exc:
            if cache_key not in self._claim_errors:
                self._claim_errors.add(cache_key)
                log.warning("%s: device identity not checked: %s", cache_key, exc)
            return None
        uuids = claim_device_uuids(claim, slices)
        if uuids is not None:
            self._claims[cache_key] = (uid, uuids)
        return uuids

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

    async def fence_confirmed(
        self, namespace: str, name: str, body: Mapping[str, Any] | None = None
    ) -> None:
        """The API confirmed the fenced pod gone: clear the pending fence (memory and status)."""
        key = (namespace, name)
        was = self.fence_pending.pop(key, None)
        self.fences_cleared.add(key)
        self.published.pop(key, None)
        patch = {"status": {"fencePending": None}}
        try:
            await self.kube.merge_patch(OMNISTAGE, namespace, name, patch, status=True)
        except KubeError as exc:
            log.warning("%s/%s: pending fence not cleared in status: %s", namespace, name, exc)
        if was is not None and body is not None:
            self.emit(body, "FenceConfirmed", f"pod confirmed gone; fence done: {was}")

    def worker_exited(self, body: Mapping[str, Any], uid: str, message: str, now: float) -> None:
        """Count a worker's exit (once per pod) into its stage's back-off, with an Event."""
        meta = body["metadata"]
        key = (meta.get("namespace") or "default", meta["name"])
        before = self.backoffs.get(key, CrashBackoff())
        after = before.exited(uid, message, now)
        if after is before:
            return
        self.backoffs[key] = after
        self.emit(
            body,
            "WorkerExited",
            f"{message} (exit {after.restarts}; next pod in {after.delay_s():.0f}s)",
            warning=True,
        )

    async def ensure_secret(self, namespace: str) -> None:
        """Copy the worker token into the namespace's Secret (once per process)."""
        if namespace in self._secrets or self._token is None:
            return
        manifest = build_token_secret(namespace, self._token)
        if not await self.kube.create(SECRETS, namespace, manifest):
            await self.kube.merge_patch(SECRETS, namespace, manifest["metadata"]["name"], manifest)
        self._secrets.add(namespace)

    def emit(
        self, body: Mapping[str, Any], reason: str, message: str, *, warning: bool = False
    ) -> None:
        """Record an Event without blocking the hand-over."""
        meta = body["metadata"]
        level = logging.WARNING if warning else logging.INFO
        log.log(level, "%s/%s %s: %s", meta.get("namespace"), meta["name"], reason, message)
        task = asyncio.create_task(
            self.kube.event(body, reason=reason, message=message, warning=warning)
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Stop the loops and close the worker channels."""
        for loop in self._loops.values():
            if loop.task is not None:
                loop.task.cancel()
        for client in self._clients.values():
            await client.close()

    # -- loops -----------------------------------------------------------------------------

    def record_ask(self, namespace: str, name: str, when: float | None = None) -> None:
        """The stage just asked for Active (arbiter order: the most recent ask first)."""
        self.asks[(namespace, name)] = time.time() if when is None else when

    async def persist_ask(self, namespace: str, name: str) -> None:
        """Write ``status.requestedActiveAt`` of a recorded ask now."""
        when = self.asks.get((namespace, name))
        if when is None:
            return
        patch = {"status": {"requestedActiveAt": format_timestamp(when)}}
        await self.kube.merge_patch(OMNISTAGE, namespace, name, patch, status=True)

    def forget(self, namespace: str, name: str) -> None:
        """Drop the in-memory facts of a deleted stage."""
        key = (namespace, name)
        self.asks.pop(key, None)
        self.last_acks.pop(key, None)
        self.fenced.pop(key, None)
        self.auth_errors.pop(key, None)
        self.published.pop(key, None)
        self.fence_pending.pop(key, None)
        self.fences_cleared.discard(key)
        self.learned.pop(key, None)
        self.backoffs.pop(key, None)
        self.active_since.pop(key, None)
        self.sleep_problems.pop(key, None)
        self.wake_problems.pop(key, None)

    def kick_all(self) -> None:
        """Ask for a round of every group seen so far (e.g. on becoming the leader)."""
        for namespace, group in list(self._loops):
            self.kick(namespace, group)

    def kick(self, namespace: str, group: str) -> None:
        """Ask for a round of the group (coalesced with one in progress)."""
        loop = self._loops.setdefault((namespace, group), _Loop())
        loop.dirty.set()
        if loop.task is None or loop.task.done():
            loop.task = asyncio.create_task(self._run(namespace, group, loop))

    def _followup(self, namespace: str, group: str, loop: _Loop, delay: float) -> None:
        if loop.followup is not None:
            loop.followup.cancel()
        loop.followup = asyncio.get_running_loop().call_later(delay, self.kick, namespace, group)

    async def _run(self, namespace: str, group: str, loop: _Loop) -> None:
        while loop.dirty.is_set():
            loop.dirty.clear()
            try:
                busy = await self.round(namespace, group)
            except Exception:
                log.exception("round of group %s/%s failed; retrying", namespace, group)
                metrics.ROUNDS.labels(namespace, group, "error").inc()
                loop.backoff_s = min(loop.backoff_s * 2, 5.0)
                self._followup(namespace, group, loop, loop.backoff_s)
                return
            retry = self._retry_in.pop((namespace, group), None)
            if busy:
                self._followup(namespace, group, loop, loop.backoff_s)
                loop.backoff_s = min(loop.backoff_s * 1.5, 2.0)
            else:
                loop.backoff_s = 0.2
                if retry is not None:  # a crash back-off ends: create the stage's pod then
                    self._followup(namespace, group, loop, retry + 0.05)

    async def round(self, namespace: str, group: str) -> bool:
        """One round; True when something is still in progress (poll again soon).

        Runs only while this operator leads; leadership lost in the middle ends the round
        (``LeadershipLost`` from the port) with nothing more ordered or published: the new
        leader's first round reads every worker's real state."""
        if not self.leadership.leading():
            log.debug("group %s/%s: not leading, no round", namespace, group)
            return False
        port = KubeGroupPort(self, namespace, group)
        t0 = time.monotonic()
        try:
            outcome = await run_round(port, self.policy, self.new_id)
        except LeadershipLost as exc:
            log.warning("group %s/%s: round ended: %s", namespace, group, exc)
            metrics.ROUNDS.labels(namespace, group, "leadership_lost").inc()
            return False
        if outcome.sleeps or outcome.wakes:
            took = time.monotonic() - t0
            metrics.HANDOVER_SECONDS.labels(namespace, group).observe(took)
            log.info(
                "group %s/%s hand-over %s: slept %s, woke %s in %.3fs",
                namespace, group, outcome.handover_id,
                [s.order.stage for s in outcome.sleeps], list(outcome.wakes), took,
            )  # fmt: skip
        metrics.ROUNDS.labels(namespace, group, "acted" if outcome.changed else "idle").inc()
        self._remember(namespace, outcome)
        if port.held_back:
            self._retry_in[(namespace, group)] = min(port.held_back.values())
        await self.publish(port, outcome)
        facts = port.facts.values()
        return (
            any(f.phase in _BUSY for f in facts)
            or bool(outcome.wake_errors)
            or any(not s.ok and not s.fenced for s in outcome.sleeps)
        )

    def _remember(self, namespace: str, outcome: RoundOutcome) -> None:
        """Keep what a round learned beyond the round: needs, and the workers' own words on a
        sleep or wake that did not go through (until one does)."""
        for name, need in outcome.learned_needs.items():
            self.learned[(namespace, name)] = need
        for s in outcome.sleeps:
            key = (namespace, s.order.stage)
            if s.ok:
                self.sleep_problems.pop(key, None)
            else:
                self.sleep_problems[key] = (s.reason.value, s.message)
        for name in outcome.wakes:
            if name not in outcome.wake_errors:
                self.wake_problems.pop((namespace, name), None)
        for name, err in outcome.wake_errors.items():
            refused = name in outcome.wake_refusals
            reason = cond.Reason.WAKE_REFUSED if refused else cond.Reason.ACK_FAILED
            self.wake_problems[(namespace, name)] = (reason.value, err)

    # -- status ----------------------------------------------------------------------------

    def _events(self, port: KubeGroupPort, outcome: RoundOutcome) -> None:
        for s in outcome.sleeps:
            body = port.bodies.get(s.order.stage)
            if body is None:
                continue
            if s.ok and s.ack is not None:
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
                self.emit(body, "Woken", msg)
        for name, err in outcome.wake_errors.items():
            body = port.bodies.get(name)
            if body is not None:
                refused = name in outcome.wake_refusals
                self.emit(body, "WakeRefused" if refused else "WakeFailed", err, warning=True)
        for name in outcome.started:
            body = port.bodies.get(name)
            if body is not None:
                self.emit(body, "PodCreated", "worker pod created asleep")

    async def publish(
        self, port: KubeGroupPort, outcome: RoundOutcome, *, events: bool = True
    ) -> None:
        """Patch every stage's status from the facts (only where it changed)."""
        if events:
            self._events(port, outcome)
        decision = outcome.decision
        now = datetime.now(UTC)
        patches = []
        for name, spec in port.specs.items():
            key = (port.ns, name)
            body = port.bodies[name]
            fact = port.facts.get(name, StageFacts(WorkerPhase.ABSENT))
            if fact.phase is WorkerPhase.ACTIVE:
                self.fenced.pop(key, None)
                self.wake_problems.pop(key, None)
            pod = port.pods.get(name)
            obs = StageObservation(
                generation=spec.generation,
                wants_active=spec.wants_active,
                phase=fact.phase,
                report=port.reports.get(name),
                pod=pod["metadata"]["name"] if pod else None,
                node=(pod.get("spec") or {}).get("nodeName") if pod else None,
                last_ack=self.last_acks.get(key),
                admitted=decision is not None and name in decision.admitted,
                waiting=decision.waiting.get(name, ()) if decision is not None else (),
                fenced_reason=self.fenced.get(key),
                requested_active_at=self.asks.get(key) if spec.wants_active else None,
                sleep_level=spec.sleep_level,
                waking=decision is not None and name in decision.wake,
                worker_error=self.auth_errors.get(key),
                fence_pending=self.fence_pending.get(key),
                learned_need=self.learned.get(key) or None,
                sleep_problem=self.sleep_problems.get(key),
                wake_problem=self.wake_problems.get(key),
            )
            previous = self.published.get(key) or body.get("status") or {}
            status = build_status(obs, previous, now)
            self._extend_status(status, port, name, now)
            self._condition_events(body, previous, status)
            if _same(status, self.published.get(key)):
                continue
            old_state = previous.get("state")
            if old_state != status["state"]:
                self.emit(body, "StateChanged", f"{old_state or 'None'} -> {status['state']}")
            self.published[key] = status
            patches.append(self._patch_status(port.ns, name, status))
        for name, (body, exc) in port.invalid.items():
            status = {"state": "Failed", "observedGeneration": body["metadata"].get("generation")}
            if _same(status, self.published.get((port.ns, name))):
                continue
            self.published[(port.ns, name)] = status
            self.emit(body, "SpecInvalid", str(exc), warning=True)
            patches.append(self._patch_status(port.ns, name, status))
        await asyncio.gather(*patches)

    def _extend_status(
        self, status: dict[str, Any], port: KubeGroupPort, name: str, now: datetime
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

    async def _patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        try:
            await self.kube.merge_patch(OMNISTAGE, namespace, name, {"status": status}, status=True)
        except KubeError as exc:
            self.published.pop((namespace, name), None)
            log.warning("status of %s/%s not written: %s", namespace, name, exc)

    async def cleanup_stage(self, body: Mapping[str, Any]) -> None:
        """Delete a stage's pod (until confirmed gone), Service, and the claim of an empty group."""
        ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
        try:
            spec: StageSpec | None = parse_stage(body)
        except SpecError:
            spec = None
        pod_name = f"{name}-worker"
        pod = await self.kube.get(PODS, ns, pod_name)
        if pod is not None:
            uid = pod["metadata"]["uid"]
            await self.kube.delete(PODS, ns, pod_name, uid=uid)
            if not await self.kube.wait_gone(
                PODS, ns, pod_name, uid, self.settings.fence_timeout_s
            ):
                raise FenceFailed(f"pod {pod_name} not confirmed gone")
        await self.kube.delete(SERVICES, ns, f"{name}-worker")
        group = group_of(body)
        if group is not None and (spec is None or self.claim_for(spec) is not None):
            others = [
                b
                for b in await self.kube.list(OMNISTAGE, ns)
                if group_of(b) == group
                and b["metadata"]["name"] != name
                and not b["metadata"].get("deletionTimestamp")
            ]
            if not others:
                await self.kube.delete(CLAIMS, ns, claim_name(group))
                log.info("%s: group %s empty, claim deleted", ns, group)
        self.forget(ns, name)


def _same(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None) -> bool:
    """Equal ignoring condition transition times' formatting noise (None-safe)."""
    return a == b
