"""What a hand-over round sees of its group (``FactsPort``, between ``port_listing.ListingPort``
and ``port.KubeGroupPort``): every worker's GetStatus turned into the arbiter's facts and the
specs into its intents, with what a previous round or process persisted (pending fences, learned
needs, per-device peaks) and what holds a stage back (crash and wake-OOM back-offs, a device
count other than ``spec.gpus``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from omnistage_operator.api.conditions import Reason
from omnistage_operator.api.labels import GROUP_LABEL
from omnistage_operator.api.spec import Backend, DesiredState, StageSpec
from omnistage_operator.decisions.arbiter import StageFacts, StageIntent, WorkerPhase
from omnistage_operator.decisions.facts import WorkerReport
from omnistage_operator.decisions.handover import (
    WorkerRefused,
    WorkerUnauthenticated,
    WorkerUnavailable,
)
from omnistage_operator.decisions.peaks import StagePeaks
from omnistage_operator.decisions.peaks import from_status as peaks_from_status
from omnistage_operator.decisions.pods import (
    RESET_AFTER_S,
    TERMINAL_PHASES,
    container_started,
    exit_message,
)
from omnistage_operator.decisions.remembered import adopt_status
from omnistage_operator.decisions.status import parse_timestamp, persisted_facts
from omnistage_operator.k8s.builders import INITIAL_STATE_ANNOTATION
from omnistage_operator.k8s.port_listing import ListingPort, _built_from

__all__ = ["FactsPort", "deepen_level", "loading_asleep"]

DEVICE_MISMATCH = Reason.DEVICE_MISMATCH.value

log = logging.getLogger(__name__)

StageKey = tuple[str, str]  # (namespace, stage)
_TERMINAL = TERMINAL_PHASES
_NOT_LOADED = frozenset({WorkerPhase.ABSENT, WorkerPhase.STARTING, WorkerPhase.LOADING})


class FactsPort(ListingPort):
    """Facts and intents of one round of one group."""

    def _intent(self, spec: StageSpec, body: Mapping[str, Any], fact: StageFacts) -> StageIntent:
        """The arbiter's view of a spec. A stage whose worker has not loaded yet (no pod, pod
        starting, worker loading) does not ask for memory yet: it could not be woken anyway,
        and a worker that never loads (a wrong model path) must not put the group's healthy
        stages to sleep. Its ask time is kept, so it takes its turn once loaded.

        A vLLM stage is charged what its engine will take (``memory_share``: its
        gpuMemoryUtilization of each device; and its ``vram_request``) from the start, also
        while pre-warmed asleep with nothing on the device: its first wake starts the engine."""
        deleting = bool(body["metadata"].get("deletionTimestamp"))
        want = spec.wants_active and not deleting
        ready = fact.phase not in _NOT_LOADED
        vllm = spec.backend is Backend.VLLM
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
            memory_share=spec.vllm.gpu_memory_utilization if vllm else None,
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
                self.r.settings.status_timeout_s, self.r.epoch_for(self.ns)
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
            self.r.reached[key] = uid
            kept, held = self._peaks(key, rep, uid)
            return rep.stage_facts(learned_need=learned, device_peaks=kept, device_held=held)
        if phase == "Pending" and not container_started(pod):
            return StageFacts(WorkerPhase.STARTING)
        if self.r.created.get(key) == uid and self.r.reached.get(key) != uid:
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
        """A stage whose last wake ran out of device memory, or failed (a vLLM engine that could
        not start), does not ask for memory again before its back-off ends (then, after an
        OOM, the gate waits for measured free memory that covers its learned need); an Active
        one keeps its admission."""
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
                self.r.fence_confirmed(self.ns, name, self.bodies[name])

    def _note_exits(self, names: list[str]) -> None:
        """Count exited worker containers into each stage's back-off; reset the back-off of a
        stage whose pod has run Active long enough, or whose pod spec changed since."""
        now = time.time()
        self.held_back.clear()
        for name in names:
            key = (self.ns, name)
            pod = self.pods.get(name)
            fact = self.facts[name]
            spec_hash = self.spec_hash(name)
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


def loading_asleep(fact: StageFacts, pod: Mapping[str, Any] | None) -> StageFacts:
    """The arbiter's view of a worker still loading in a pod created asleep: it loads into
    host memory and holds only its context on the device, like a pod whose worker is not
    reached yet (``STARTING``: charged a context), so it does not hold up every wake of its
    group for its whole load (issue 19). A pod created Active stays ``LOADING``."""
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
