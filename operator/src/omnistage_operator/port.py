"""The Kubernetes side of a hand-over round: ``KubeGroupPort`` implements ``handover.GroupPort``.

For one round of one group it reads the group's OmniStages and worker pods from the watches
(``views``: no LIST of the namespace), asks every worker for
its GetStatus, turns both into the arbiter's intents and facts (with what a previous round or
process persisted: pending fences, learned needs, crash back-offs), creates a stage's children
(always asleep), and carries out Sleep, WakeUp and fences, checking before each order that this
operator still leads.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from omnistage_operator import metrics
from omnistage_operator.arbiter import (
    StageFacts,
    StageIntent,
    WorkerPhase,
)
from omnistage_operator.builders import (
    INITIAL_STATE_ANNOTATION,
    POD_SPEC_HASH_ANNOTATION,
    build_group_claim,
    build_service,
    build_worker_pod,
    can_start_asleep,
    owner_reference,
)
from omnistage_operator.conditions import Reason
from omnistage_operator.facts import AckFacts, WorkerReport
from omnistage_operator.handover import (
    FenceFailed,
    GroupObservation,
    RoundOutcome,
    WorkerRefused,
    WorkerUnauthenticated,
    WorkerUnavailable,
)
from omnistage_operator.kube import CLAIMS, PODS, SERVICES
from omnistage_operator.labels import (
    GROUP_LABEL,
    STAGE_LABEL,
)
from omnistage_operator.leadership import LeadershipLost
from omnistage_operator.memory import group_memory
from omnistage_operator.ondemand import DemandView
from omnistage_operator.peaks import StagePeaks
from omnistage_operator.peaks import from_status as peaks_from_status
from omnistage_operator.pod_hash import pod_spec_hash
from omnistage_operator.pods import (
    RESET_AFTER_S,
    TERMINAL_PHASES,
    container_started,
    exit_message,
)
from omnistage_operator.remembered import adopt_status
from omnistage_operator.spec import DesiredState, SpecError, StageSpec
from omnistage_operator.spec_parse import parse_stage
from omnistage_operator.status import (
    parse_timestamp,
    persisted_facts,
)
from omnistage_operator.views import group_of
from omnistage_operator.worker_client import WorkerClient

if TYPE_CHECKING:
    from omnistage_operator.runner import GroupRunner

__all__ = ["KubeGroupPort", "group_of"]

DEVICE_MISMATCH = Reason.DEVICE_MISMATCH.value

log = logging.getLogger(__name__)

StageKey = tuple[str, str]  # (namespace, stage)
_TERMINAL = TERMINAL_PHASES
_NOT_LOADED = frozenset({WorkerPhase.ABSENT, WorkerPhase.STARTING, WorkerPhase.LOADING})


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
        self.wake_held: dict[str, float] = {}  # stages backing off after a wake out of memory
        self.demand = DemandView({}, {}, frozenset(), None)  # shaped by the last observe
        # Stages that asked for Active for held requests in this round: (held, oldest hold).
        self.demand_asked: dict[str, tuple[int, float | None]] = {}
        self.demand_idle: set[str] = set()  # stages found idle in this round
        self._listed = False
        # The claim's device UUIDs, read with the listing (a round reads them once, again only
        # after it created or deleted a pod): not a GET on every observe of the hand-over path.
        self._claim_uuids: tuple[str, ...] | None = None
        self._claims_read = False

    # -- observing -------------------------------------------------------------------------

    def _intent(self, spec: StageSpec, body: Mapping[str, Any], fact: StageFacts) -> StageIntent:
        """The arbiter's view of a spec. A stage whose worker has not loaded yet (no pod, pod
        starting, worker loading) does not ask for memory yet: it could not be woken anyway,
        and a worker that never loads (a wrong model path) must not put the group's healthy
        stages to sleep. Its ask time is kept, so it takes its turn once loaded."""
        deleting = bool(body["metadata"].get("deletionTimestamp"))
        want = spec.wants_active and not deleting
        starts_active = not can_start_asleep(spec)
        # A stage that starts Active (vLLM) asks while absent (its pod starts once admitted)
        # and keeps its admission while its engine starts and loads.
        ready = fact.phase not in _NOT_LOADED or starts_active
        key = (self.ns, spec.name)
        if self.r.spec_active.get(key) and not spec.wants_active:
            self.r.asleep_asked[key] = time.time()  # patched Asleep: now, not when idle
        elif spec.wants_active or fact.phase is WorkerPhase.ASLEEP:
            self.r.asleep_asked.pop(key, None)  # done (asleep), or asked Active again
            self.r.asleep_restored.discard(key)
        self.r.spec_active[key] = spec.wants_active
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
            sleep_level=self._sleep_level(spec, fact),
            vram_request=spec.vram_request_bytes,
            gpus=spec.gpus,
            drain_timeout_s=float(spec.drain_timeout_s),
            asleep_components=self._asleep_components(spec, fact),
            starts_active=starts_active,
            memory_share=spec.vllm.gpu_memory_utilization if starts_active else None,
        )

    def _sleep_level(self, spec: StageSpec, fact: StageFacts) -> int:
        """The spec's sleep level; while the worker refused to deepen to it (1->2 without
        waking), the level it is at: no order again every round, until the spec changes or
        the stage wakes."""
        key = (self.ns, spec.name)
        level = deepen_level(spec.sleep_level, fact, self.r.deepen_refused.get(key))
        if level == spec.sleep_level:
            self.r.deepen_refused.pop(key, None)
        return level

    def _asleep_components(self, spec: StageSpec, fact: StageFacts) -> frozenset[str]:
        """The spec's asleepComponents; while the worker refused to sleep exactly those (an
        unknown name, sequential mode), what the worker has: no order until the spec changes."""
        key = (self.ns, spec.name)
        refused = self.r.component_refused.get(key)
        if refused is None:
            return frozenset(spec.asleep_components)
        if set(refused) == set(spec.asleep_components) - fact.asleep_components:
            return fact.asleep_components
        self.r.component_refused.pop(key, None)
        self.r.component_problems.pop(key, None)
        return frozenset(spec.asleep_components)

    async def _status_of(self, name: str, pod: Mapping[str, Any]) -> WorkerReport | None:
        client = self.r.client_for(self.ns, self.specs[name], pod)
        if client is None:
            return None
        key = (self.ns, name)
        try:
            report = await client.get_status(
                self.r.settings.status_timeout_s, self.r.leadership.epoch
            )
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
                kept, held = self._peaks(key, rep, uid)
                return rep.stage_facts(
                    fence_pending=True, learned_need=learned, device_peaks=kept, device_held=held
                )
            return StageFacts(WorkerPhase.UNREACHABLE, fence_pending=True, learned_need=learned)
        if phase in _TERMINAL:
            return StageFacts(WorkerPhase.ABSENT)  # the kubelet reported its containers ended
        if rep is not None:
            self.r.reached.add(uid)
            kept, held = self._peaks(key, rep, uid)
            return rep.stage_facts(learned_need=learned, device_peaks=kept, device_held=held)
        if phase == "Pending" and not container_started(pod):
            return StageFacts(WorkerPhase.STARTING)
        if uid in self.r.created and uid not in self.r.reached:
            return StageFacts(WorkerPhase.STARTING)
        return StageFacts(WorkerPhase.UNREACHABLE)

    def _peaks(
        self, key: StageKey, rep: WorkerReport, uid: str
    ) -> tuple[dict[str, int], dict[str, int]]:
        """Count the report of the worker in pod ``uid`` into the stage's per-device peaks:
        (kept, held since its wake)."""
        peaks = self.r.peaks.get(key, StagePeaks()).seen(rep, uid)
        self.r.peaks[key] = peaks
        return dict(peaks.kept), dict(peaks.since_wake)

    def _acked(self, stage: str, ack: AckFacts) -> None:
        """Keep an ACK for status, and count it into the stage's per-device peaks."""
        key = (self.ns, stage)
        self.r.last_acks[key] = ack
        self.r.peaks[key] = self.r.peaks.get(key, StagePeaks()).acked(ack)

    async def observe(self) -> GroupObservation:
        """Read the group's specs, pods, claim and every worker's GetStatus.

        Within one round, specs, pods and the claim are read again only after this port created
        or deleted a pod; otherwise only the workers are asked again (a spec changed meanwhile
        kicks another round).
        """
        if not self._listed:
            await self._list()
            self._listed = True
            self._claims_read = False
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
        if not self._claims_read:
            self._claim_uuids = await self.r.claim_uuids(self.ns, self.group, self.specs)
            self._claims_read = True
        claim_uuids = self._claim_uuids
        memory = group_memory(
            {n: r for n, r in self.reports.items() if n in arbitrated},
            {n: self.specs[n].gpus for n in arbitrated},
            claim_uuids,
        )
        intents = {
            n: self._intent(self.specs[n], self.bodies[n], self.facts[n]) for n in arbitrated
        }
        # OnDemand stages: their workers' demand is a fact the arbiter sees as intents.
        self.demand = self.r.demand.shape(self, intents)
        intents = self._refuse_mismatched(self._hold_wakes(self.demand.intents))
        for name in self.demand.demand_asks:  # kept for the round's Events (held until woken)
            self.demand_asked.setdefault(name, self.r.demand.held(self.ns, name))
        self.demand_idle |= self.demand.idle
        facts = {n: loading_asleep(self.facts[n], self.pods.get(n)) for n in arbitrated}
        return GroupObservation(intents, facts, memory)

    def _refuse_mismatched(self, intents: Mapping[str, StageIntent]) -> dict[str, StageIntent]:
        """A worker that reports another number of devices than ``spec.gpus`` measures other
        memory than the arbiter charges: it is never admitted (an Active one is put to sleep),
        with a ``DeviceMismatch`` reason (on Ready: the publisher's Warning Event follows)."""
        out = dict(intents)
        for name, intent in intents.items():
            key = (self.ns, name)
            rep = self.reports.get(name)
            expected = max(1, self.specs[name].gpus)
            if rep is None or not rep.devices or len(rep.devices) == expected:
                if key in self.r.device_mismatch and rep is not None:
                    del self.r.device_mismatch[key]
                    self.r.stage_problems.pop(key, None)
                continue
            message = (
                f"the worker reports {len(rep.devices)} device(s) "
                f"({', '.join(d.uuid or str(d.index) for d in rep.devices)}) but spec.gpus is "
                f"{self.specs[name].gpus}: its figures do not cover the stage's devices, so it is "
                "never admitted (replace its pod)"
            )
            if self.r.device_mismatch.get(key) != message:  # the Event: the Ready condition's
                log.warning("%s/%s: %s", self.ns, name, message)
            self.r.device_mismatch[key] = message
            self.r.stage_problems[key] = (DEVICE_MISMATCH, message)
            out[name] = replace(intent, want_active=False)
        return out

    def _hold_wakes(self, intents: Mapping[str, StageIntent]) -> dict[str, StageIntent]:
        """A stage whose last wake ran out of device memory does not ask for memory again
        before its back-off ends (then the gate waits for measured free memory that covers its
        learned need); an Active one keeps its admission."""
        now = time.time()
        held = dict(intents)
        self.wake_held.clear()
        for name, intent in intents.items():
            backoff = self.r.wake_backoffs.get((self.ns, name))
            left = backoff.left(now) if backoff is not None else 0.0
            if intent.want_active and left > 0 and self.facts[name].phase is not WorkerPhase.ACTIVE:
                self.wake_held[name] = left
                held[name] = replace(intent, want_active=False)
        return held

    async def _adopt_persisted(self, names: list[str]) -> None:
        """Facts a previous operator process persisted in status (a pending fence, a learned
        need) come back; a pending fence whose pod the API no longer lists is confirmed."""
        for name in names:
            key = (self.ns, name)
            adopt_status(self.r, key, self.bodies[name].get("status"), self.specs[name])
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
            if key not in self.r.peaks:
                kept = peaks_from_status(self.bodies[name].get("status"))
                if kept is not None:
                    self.r.peaks[key] = kept
            if key in self.r.fence_pending and name not in self.pods:
                await self.r.fence_confirmed(self.ns, name, self.bodies[name])

    def _note_exits(self, names: list[str]) -> None:
        """Count exited worker containers into each stage's back-off; reset the back-off of a
        stage whose pod has run Active long enough, or whose pod spec changed since."""
        now = time.time()
        self.held_back.clear()
        for name in names:
            key = (self.ns, name)
            pod = self.pods.get(name)
            fact = self.facts[name]
            spec_hash = pod_spec_hash(self.specs[name])
            counted = self.r.backoffs.get(key)
            if counted is not None and not counted.current(spec_hash):
                del self.r.backoffs[key]
                self.r.emit(self.bodies[name], "BackoffReset", "the pod spec changed: no back-off")
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
                and _built_from(pod, spec_hash)  # an older spec's exit says nothing of this one
            ):
                message = exit_message(pod) or "worker container ended"
                self.r.worker_exited(
                    self.bodies[name], pod["metadata"]["uid"], message, now, spec_hash
                )
            backoff = self.r.backoffs.get(key)
            if backoff is not None and fact.phase is WorkerPhase.ABSENT:
                left = backoff.waiting(now)
                if left > 0:
                    self.held_back[name] = left

    async def _list(self) -> None:
        """The group's stages and worker pods, from the watches (``views``): no LIST."""
        await self.r.ensure_secret(self.ns)  # also repairs a Secret left from another token
        bodies = self.r.views.stages(self.ns, self.group)
        self.specs.clear()
        self.bodies.clear()
        self.invalid.clear()
        for body in bodies:
            try:
                spec = parse_stage(body)
            except SpecError as exc:
                self.invalid[body["metadata"]["name"]] = (body, exc)
                continue
            self.specs[spec.name] = spec
            self.bodies[spec.name] = body
        pods = self.r.views.pods(self.ns, self.group, self.specs)
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
            await self._fence_orphan(pod)
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
        self.r.peaks[(self.ns, stage)] = StagePeaks()  # the new spec's pod is measured anew
        self.r.backoffs.pop((self.ns, stage), None)
        await self._delete_confirmed(pod, f"outdated pod {meta['name']} not confirmed gone")
        self.r.emit(body, "PodReplaced", f"outdated pod {meta['name']} deleted and confirmed gone")

    async def _fence_orphan(self, pod: Mapping[str, Any]) -> None:
        """A pod labelled with this group whose stage is no longer arbitrated here (its spec
        became invalid, or it was re-created in another group) may hold this group's memory:
        delete it and wait until the API server confirms it is gone."""
        meta = pod["metadata"]
        stage = meta.get("labels", {}).get(STAGE_LABEL, "")
        body = self.r.views.stage(self.ns, stage)
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
        if not await self.r.delete_pod(self.ns, pod, grace_s=grace_s):
            if count_timeout:
                metrics.FENCES.labels(self.ns, self.group, "timeout").inc()
            raise FenceFailed(failure)

    # -- acting ----------------------------------------------------------------------------

    async def start(self, stage: str, *, active: bool = False) -> None:
        """Create the stage's token Secret, group claim, Pod (asleep, or Active when ``active``:
        a stage that cannot start asleep, admitted by the arbiter) and Service."""
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
        state = DesiredState.ACTIVE if active else DesiredState.ASLEEP
        pod = self.r.credentials.adapt(build_worker_pod(
            spec, initial_state=state, owner=owner, claim_name=claim,
            epoch=self.r.leadership.epoch,
        ))  # fmt: skip
        created = await self.r.kube.create_returning(PODS, self.ns, pod)
        if created is not None:
            self.r.created.add(created["metadata"]["uid"])
            self.r.views.created(self.ns, stage, created)
            log.info(
                "%s/%s: created pod %s (%s)", self.ns, stage, pod["metadata"]["name"], state.value
            )
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
        components: tuple[str, ...] = (),
    ) -> AckFacts:
        """Sleep (of ``components`` only, when named); the request carries the stage's drain
        timeout, and the call's deadline is
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
            level, task_id, deadline, epoch=self.r.leadership.epoch, drain_timeout_s=drain,
            components=components,
        )  # fmt: skip
        metrics.ACK_SECONDS.labels("sleep").observe(time.monotonic() - t0)
        self._acked(stage, ack)
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
        self._acked(stage, ack)
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
        if pod is not None and not await self.r.delete_pod(self.ns, pod, grace_s=5):
            metrics.FENCES.labels(self.ns, self.group, "timeout").inc()
            name = pod["metadata"]["name"]
            self.r.emit(body, "FenceFailed", f"pod {name} still exists", warning=True)
            raise FenceFailed(f"pod {name} of {stage} not confirmed gone")
        self._listed = False
        await self.r.fence_confirmed(self.ns, stage, body)
        metrics.FENCES.labels(self.ns, self.group, "fenced").inc()
        self.r.fenced[key] = reason
        self.r.emit(
            body, "Fenced", f"worker pod deleted and confirmed gone: {reason}", warning=True
        )
        spec_hash = pod_spec_hash(self.specs[stage])
        if (
            pod is not None
            and rep is not None
            and rep.phase is WorkerPhase.FAILED
            and _built_from(pod, spec_hash)
        ):
            # A worker that failed (at load, or a residual it could not release) is a crash:
            # its stage backs off before a new pod, with the worker's own reason in status.
            why = f"worker failed: {rep.error}" if rep.error else "worker failed"
            self.r.worker_exited(body, pod["metadata"]["uid"], why, time.time(), spec_hash)


def loading_asleep(fact: StageFacts, pod: Mapping[str, Any] | None) -> StageFacts:
    """The arbiter's view of a worker still loading in a pod created asleep: it loads into
    host memory and holds only its context on the device, like a pod whose worker is not
    reached yet (``STARTING``: charged a context), so it does not hold up every wake of its
    group for its whole load (issue 19). A pod created Active (vLLM) stays ``LOADING``."""
    if fact.phase is not WorkerPhase.LOADING or pod is None:
        return fact
    created = (pod["metadata"].get("annotations") or {}).get(INITIAL_STATE_ANNOTATION)
    if created != DesiredState.ASLEEP.value:
        return fact
    return replace(fact, phase=WorkerPhase.STARTING)


def deepen_level(wanted: int, fact: StageFacts, refused: int | None) -> int:
    """The level to ask an asleep worker for: ``wanted``, unless the worker refused exactly
    that deepening and is still asleep below it (then its own level)."""
    if refused is None or refused != wanted or fact.phase is not WorkerPhase.ASLEEP:
        return wanted
    if fact.level is None or fact.level >= wanted:
        return wanted
    return fact.level


def _built_from(pod: Mapping[str, Any], spec_hash: str) -> bool:
    """The pod was built from the pod spec ``spec_hash`` (or says nothing of its spec)."""
    built = (pod["metadata"].get("annotations") or {}).get(POD_SPEC_HASH_ANNOTATION)
    return built is None or built == spec_hash


def _outdated(pod: Mapping[str, Any], spec: StageSpec) -> bool:
    """The pod was built from another version of the fields a pod is made of."""
    if (pod.get("status") or {}).get("phase") in _TERMINAL or pod["metadata"].get(
        "deletionTimestamp"
    ):
        return False  # ended or already going: the round's usual path handles it
    built = (pod["metadata"].get("annotations") or {}).get(POD_SPEC_HASH_ANNOTATION)
    return built is not None and built != pod_spec_hash(spec)
