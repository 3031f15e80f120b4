"""The Kubernetes side of a hand-over round: ``KubeGroupPort`` implements ``handover.GroupPort``.

For one round of one group it reads the group's OmniStages and worker pods from the watches
(``views``: no LIST of the namespace), asks every worker for
its GetStatus, turns both into the arbiter's intents and facts (with what a previous round or
process persisted: pending fences, learned needs, crash back-offs), creates a stage's children
(always asleep), and carries out Sleep, WakeUp and fences, checking before each order that this
operator still leads.

Its bases read the group: ``port_listing`` (the round's state, the listing from the watches, the
pods deleted before the round acts) and ``port_facts`` (GetStatus turned into facts and intents).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine, Mapping
from typing import TYPE_CHECKING, Any

from omnistage_operator.api.labels import GROUP_LABEL
from omnistage_operator.api.spec import DesiredState
from omnistage_operator.decisions.arbiter import StageFacts, WorkerPhase
from omnistage_operator.decisions.facts import AckFacts, WorkerReport
from omnistage_operator.decisions.handover import (
    FenceFailed,
    GroupObservation,
    RoundOutcome,
    StageDeleting,
)
from omnistage_operator.decisions.memory import group_memory
from omnistage_operator.decisions.readings import (
    KeptReadings,
    acked_memory,
    acks_measure,
    keep_readings,
    kept_reports,
    reuse_reports,
)
from omnistage_operator.k8s import metrics
from omnistage_operator.k8s.builders import (
    build_group_claim,
    build_service,
    build_worker_pod,
    owner_reference,
)
from omnistage_operator.k8s.group_claims import claim_holders
from omnistage_operator.k8s.kube import CLAIMS, PODS, SERVICES
from omnistage_operator.k8s.port_facts import loading_asleep
from omnistage_operator.k8s.port_listing import _built_from
from omnistage_operator.k8s.port_orders import OrdersPort
from omnistage_operator.k8s.views import group_of

if TYPE_CHECKING:
    from omnistage_operator.k8s.port_host import PortHost

__all__ = ["KubeGroupPort", "group_of"]

log = logging.getLogger(__name__)

# A wake after a checkpoint still running this long shows Waking in its stage's status. Longer
# than a usual wake (0.9 s for the 16.6 GiB model on the GPU host; a status PATCH of an OmniStage
# costs the API server 7-15 ms of CPU): a usual hand-over writes each stage's status once.
WAKING_STATUS_AFTER_S = 1.0
# In a storm (the runner's ``storming``) a wake's time is mostly queueing: in a 1000-stage
# hand-over storm on the GPU host's cores (scale_1000_opcores_shards1.json) 355 of 500 wakes,
# each 0.1 s on its simulated worker, passed 1 s, and their Waking writes were a quarter of the
# storm's status writes, each also CPU of the operator, whose CPU bounded that storm. There
# only a wake this long shows Waking.
WAKING_STATUS_IN_STORM_S = 5.0


class KubeGroupPort(OrdersPort):
    """``GroupPort`` of one group, for one round."""

    _checkpointed: RoundOutcome | None = None  # the round's checkpoint, once started
    # Its writes (the publish, a task) and the stages they concern.
    _checkpoint_writes: asyncio.Task[None] | None = None
    _checkpoint_stages: frozenset[str] = frozenset()
    _waking_written: set[str]

    def __init__(
        self,
        runner: PortHost,
        namespace: str,
        group: str,
        kept: KeptReadings | None = None,
    ) -> None:
        """``kept``: the group's readings from its last round (its first observe may answer
        from them: ``readings.kept_reports``)."""
        super().__init__(runner, namespace, group)
        self._waking_written = set()
        # Since the last observe: whether a pod was created or fenced (then every worker is
        # asked again).
        self._reread = False
        self._kept = kept
        self._from_kept = False  # the last observe answered from kept readings
        # Then: the asleep workers' GetStatus, sent at once and taken by the next observe.
        self._early: dict[str, asyncio.Future[WorkerReport | None]] = {}

    async def observe(self) -> GroupObservation:
        """Read the group's specs, pods, claim and every worker's GetStatus.

        Within one round, specs, pods and the claim are read again only after this port created
        or deleted a pod; otherwise only the workers are asked again (a spec changed meanwhile
        kicks another round), and not even they when the round's ACKs already say where the
        group stands (``readings.reuse_reports``: every worker ordered since answered with an
        ok ACK, every other one is asleep; each device's free memory is then the latest ACK's
        reading of it). A round's first observe answers from the group's kept readings while
        they are still the group's (``readings.kept_reports``); the next one reads every worker
        unless the sleeps sent since say where the group stands and measured every device.
        """
        ordered, acks, reread = self._ordered, self._acks, self._reread
        self._ordered, self._acks, self._reread = set(), {}, False
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
        kept, self._kept = self._kept, None
        after_kept, self._from_kept = self._from_kept, False
        early, self._early = self._early, {}
        answered: dict[str, WorkerReport | None] = {}
        if early:  # asked at the plan from kept readings: taken now (from pods not replaced)
            answers = await asyncio.gather(*early.values())
            answered = {} if reread else dict(zip(early, answers, strict=True))
        settled = not reread and not self.listing_deleted and set(with_pod) == set(names)
        if kept is not None and settled:
            pods = {n: _pod_key(self.pods[n]) for n in with_pod}
            reused = kept_reports(kept, pods, self.r.epoch_for(self.ns), time.monotonic())
            self._from_kept = reused is not None
            # The asleep workers are read meanwhile (beside the sleeps, for the gate after them).
            for name, report in (reused or {}).items():
                if report.phase is WorkerPhase.ASLEEP:
                    self._early[name] = _asked(self._status_of(name, self.pods[name]))
        elif after_kept:
            # After a plan from kept readings: its sleeps' ACKs and the asleep workers' answers
            # must say where the group stands, the ACKs having measured every device, else
            # every worker is read now.
            reused = None
            if ordered and not reread and all(a is not None for a in answered.values()):
                read = {n: a for n, a in answered.items() if a is not None}
                reused = reuse_reports({**self.reports, **read}, ordered, acks, with_pod)
                if reused is not None and not acks_measure(reused.values(), acks.values()):
                    reused = None
        else:
            reused = None if reread else reuse_reports(self.reports, ordered, acks, with_pod)
        if reused is None:
            unread = [n for n in with_pod if answered.get(n) is None]
            reports = await asyncio.gather(*(self._status_of(n, self.pods[n]) for n in unread))
            got: dict[str, WorkerReport | None] = dict(answered)
            got.update(zip(unread, reports, strict=True))
            self.reports = {n: rep for n in with_pod if (rep := got.get(n)) is not None}
        else:
            self.reports = reused
        self.facts = {n: self._facts(n, self.pods.get(n), self.reports.get(n)) for n in names}
        self._note_exits(names)
        # A stage in crash back-off holds nothing (its container ended) and is left out of the
        # arbitration until the back-off ends: it is neither admitted nor started, so the
        # group's healthy stages are not put to sleep for it.
        arbitrated = [n for n in names if n not in self.held_back]
        if not self._claims_read:
            holders = claim_holders(self.pods.values())
            self._claim_uuids = await self.r.claim_uuids(self.ns, self.group, self.specs, holders)
            self._claims_read = True
        claim_uuids = self._claim_uuids
        memory = group_memory(
            {n: r for n, r in self.reports.items() if n in arbitrated},
            {n: self.specs[n].gpus for n in arbitrated},
            claim_uuids,
        )
        if reused is not None:
            memory = acked_memory(memory, acks.values())
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
        return GroupObservation(intents, facts, memory, kept=self._from_kept)

    def kept_readings(self) -> KeptReadings | None:
        """This round's last readings, worth keeping for the group's next round (or None)."""
        if self._from_kept:
            return None  # never read back after a plan from kept readings
        pods = {n: _pod_key(self.pods[n]) for n in self.reports if n in self.pods}
        return keep_readings(self.reports, pods, self.r.epoch_for(self.ns), time.monotonic())

    # -- acting ----------------------------------------------------------------------------

    async def start(self, stage: str) -> None:
        """Create the stage's token Secret, group claim, Pod (asleep; a vLLM stage's pre-warmed
        at level 2, its engine started by its first wake) and Service."""
        spec, body = self.specs[stage], self.bodies[stage]
        if body["metadata"].get("deletionTimestamp"):
            raise StageDeleting(stage)
        self._ensure_leading(f"start of {stage}")
        self._reread = True
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
        state = DesiredState.ASLEEP
        pod = self.r.credentials.adapt(build_worker_pod(
            spec, initial_state=state, owner=owner, claim_name=claim,
            epoch=self.r.epoch_for(self.ns), profile=self.r.pod_profile,
        ))  # fmt: skip
        created = await self.r.kube.create_returning(PODS, self.ns, pod)
        if created is not None:
            self.r.created[(self.ns, stage)] = created["metadata"]["uid"]
            self.r.views.created(self.ns, stage, created)
            log.info(
                "%s/%s: created pod %s (%s)", self.ns, stage, pod["metadata"]["name"], state.value
            )
        await self.r.kube.create(SERVICES, self.ns, build_service(spec, owner=owner))
        self._listed = False

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
        self._ordered.add(stage)
        drain = (
            float(self.specs[stage].drain_timeout_s) if drain_timeout_s is None else drain_timeout_s
        )
        deadline = timeout_s if timeout_s is not None else drain + self.r.settings.sleep_timeout_s
        t0 = time.monotonic()
        ack = await client.sleep(
            level, task_id, deadline, epoch=self.r.epoch_for(self.ns), drain_timeout_s=drain,
            components=components,
        )  # fmt: skip
        self._counted("sleep", stage, task_id, ack, time.monotonic() - t0)
        return ack

    async def wake(self, stage: str, task_id: str) -> AckFacts:
        """WakeUp with the contract's deadline; the ACK is kept for status."""
        client = self._client(stage)
        self._ensure_leading(f"WakeUp {task_id}")
        self._ordered.add(stage)
        t0 = time.monotonic()
        shown = self._show_waking(stage)
        try:
            ack = await client.wake(
                task_id, self.r.settings.wake_timeout_s, epoch=self.r.epoch_for(self.ns)
            )
        finally:
            await self._waking_settled(stage, shown)
        self._counted("wake", stage, task_id, ack, time.monotonic() - t0)
        return ack

    async def checkpoint(self, outcome: RoundOutcome) -> None:
        """Publish the sleeps' ACKs and the fences in status before any wake goes out: the
        status of the stages they concern. A stage woken next is written by the round's
        publish after its wake (one status write less on the hand-over's path), or as Waking
        once its wake has taken ``WAKING_STATUS_AFTER_S`` (``WAKING_STATUS_IN_STORM_S`` in a
        storm; ``wake``).

        Returns once the status is built and its writes issued, not answered: the round's
        publish writes these stages only after them (``after_checkpoint``) and the woken one
        without waiting for them (under load each write waits for a request slot: two in a
        row on the hand-over's path), and the round ends once they are answered
        (``checkpoint_written``)."""
        self._checkpointed = outcome
        stages = {s.order.stage for s in outcome.sleeps} | {f.order.stage for f in outcome.fences}
        self._checkpoint_stages = frozenset(stages)
        self._checkpoint_writes = asyncio.ensure_future(
            self.r.publish(self, outcome, events=False, stages=self._checkpoint_stages)
        )
        await asyncio.sleep(0)  # the publish builds the status and issues its writes

    def after_checkpoint(self, stage: str) -> asyncio.Task[None] | None:
        """The checkpoint's writes, when they concern ``stage`` and are not the caller: a later
        write of ``stage`` waits for them, so it never lands first."""
        writes = self._checkpoint_writes
        if writes is None or stage not in self._checkpoint_stages or writes.done():
            return None
        return None if asyncio.current_task() is writes else writes

    async def checkpoint_written(self) -> None:
        """Wait until the checkpoint's writes are answered (the end of the round)."""
        if self._checkpoint_writes is not None:
            await self._checkpoint_writes

    def _show_waking(self, stage: str) -> asyncio.Task[None] | None:
        """After a checkpoint: write the stage's status (Waking) if its wake takes a while."""
        outcome = self._checkpointed
        if outcome is None:
            return None

        after_s = WAKING_STATUS_IN_STORM_S if self.r.storming else WAKING_STATUS_AFTER_S

        async def later() -> None:
            await asyncio.sleep(after_s)
            self._waking_written.add(stage)  # from here on awaited, never cancelled
            await self.r.publish(self, outcome, events=False, stages=frozenset({stage}))

        return asyncio.ensure_future(later())

    async def _waking_settled(self, stage: str, shown: asyncio.Task[None] | None) -> None:
        """A Waking write not begun is dropped; one begun is awaited, so it lands before the
        round's publish of the same stage."""
        if shown is None:
            return
        if stage not in self._waking_written:
            shown.cancel()
        await asyncio.wait([shown])  # its error is not the wake's
        if not shown.cancelled() and shown.exception() is not None:
            log.warning("%s/%s: Waking not written: %s", self.ns, stage, shown.exception())

    async def fence(self, stage: str, reason: str) -> None:
        """Delete the stage's pod; return only once the API server confirms it is gone."""
        pod = self.pods.get(stage)
        body = self.bodies[stage]
        key = (self.ns, stage)
        self._ensure_leading(f"fence of {stage}")
        self._reread = True
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
        self.r.fence_confirmed(self.ns, stage, body)
        metrics.FENCES.labels(self.ns, self.group, "fenced").inc()
        self.r.fenced[key] = reason
        self.r.emit(
            body, "Fenced", f"worker pod deleted and confirmed gone: {reason}", warning=True
        )
        spec_hash = self.spec_hash(stage)
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


def _pod_key(pod: Mapping[str, Any]) -> tuple[str, str]:
    """A pod as kept readings name it: its uid and resourceVersion (any change reads anew)."""
    meta = pod.get("metadata") or {}
    return str(meta.get("uid") or ""), str(meta.get("resourceVersion") or "")


def _asked(read: Coroutine[Any, Any, WorkerReport | None]) -> asyncio.Future[WorkerReport | None]:
    """A GetStatus sent now, taken by a later observe (an error never taken is not logged)."""
    task = asyncio.ensure_future(read)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    return task
