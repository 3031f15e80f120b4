"""The group's listing for one hand-over round (``ListingPort``, the base of
``port.KubeGroupPort``): the round's state, the group's stages and worker pods read from the
watches, and the pods deleted (confirmed gone) before the round acts: orphans of stages that left
the group, and pods that predate their stage's spec.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from omnistage_operator.api.labels import GROUP_LABEL, STAGE_LABEL
from omnistage_operator.api.spec import SpecError, StageSpec
from omnistage_operator.api.spec_parse import parse_stage
from omnistage_operator.decisions.arbiter import StageFacts
from omnistage_operator.decisions.facts import WorkerReport
from omnistage_operator.decisions.handover import FenceFailed
from omnistage_operator.decisions.leadership import LeadershipLost
from omnistage_operator.decisions.ondemand import DemandView
from omnistage_operator.decisions.peaks import StagePeaks
from omnistage_operator.decisions.pods import TERMINAL_PHASES
from omnistage_operator.k8s import metrics
from omnistage_operator.k8s.builders import POD_SPEC_HASH_ANNOTATION
from omnistage_operator.k8s.pod_hash import pod_spec_hash

if TYPE_CHECKING:
    from omnistage_operator.k8s.port_host import PortHost

__all__ = ["ListingPort"]

_TERMINAL = TERMINAL_PHASES


class ListingPort:
    """The state of one round of one group, and its listing."""

    def __init__(self, runner: PortHost, namespace: str, group: str) -> None:
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
        # Events of this round's status, posted after its last status write (publisher).
        self.held_events: list[tuple[Mapping[str, Any], str, str, bool]] = []
        self._listed = False
        # The claim's device UUIDs, read with the listing (a round reads them once, again only
        # after it created or deleted a pod): not a GET on every observe of the hand-over path.
        self._claim_uuids: tuple[str, ...] | None = None
        self._claims_read = False
        self._spec_hashes: dict[str, str] = {}  # of the specs as listed (``spec_hash``)
        self.listing_deleted = False  # the last listing deleted a pod (orphan or outdated)

    def spec_hash(self, stage: str) -> str:
        """``pod_spec_hash`` of the stage's spec as listed, computed once per listing (every
        observe of a round checks it, and it is a JSON dump and a SHA-256 of the spec)."""
        known = self._spec_hashes.get(stage)
        if known is None:
            known = self._spec_hashes[stage] = pod_spec_hash(self.specs[stage], self.r.pod_profile)
        return known

    async def _list(self) -> None:
        """The group's stages and worker pods, from the watches (``views``): no LIST."""
        await self.r.ensure_secret(self.ns)  # also repairs a Secret left from another token
        bodies = self.r.views.stages(self.ns, self.group)
        self.specs.clear()
        self.bodies.clear()
        self.invalid.clear()
        self._spec_hashes.clear()
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
        self.listing_deleted = bool(orphans)  # pods deleted before the round acts
        for pod in orphans:
            await self._fence_orphan(pod)
        for name, pod in list(self.pods.items()):
            if _outdated(pod, self.spec_hash(name)):
                self.listing_deleted = True
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
        # What was learned about the old pod (its need, its crashes, its failed wakes) is
        # about the old spec.
        self.r.learned[(self.ns, stage)] = 0
        self.r.peaks[(self.ns, stage)] = StagePeaks()  # the new spec's pod is measured anew
        self.r.backoffs.pop((self.ns, stage), None)
        self.r.wake_backoffs.pop((self.ns, stage), None)
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

    def _ensure_leading(self, what: str) -> None:
        """Raise ``LeadershipLost`` unless this operator still leads: an order (Sleep, WakeUp,
        a fence's delete) is never sent by a process that may have been replaced."""
        if not self.r.may_order(self.ns):
            raise LeadershipLost(
                f"{what} in group {self.ns}/{self.group}: no longer leading, or the "
                "namespace's claim is no longer this shard's"
            )


def _built_from(pod: Mapping[str, Any], spec_hash: str) -> bool:
    """The pod was built from the pod spec ``spec_hash`` (or says nothing of its spec)."""
    built = (pod["metadata"].get("annotations") or {}).get(POD_SPEC_HASH_ANNOTATION)
    return built is None or built == spec_hash


def _outdated(pod: Mapping[str, Any], spec_hash: str) -> bool:
    """The pod was built from another version of the fields (or operator settings) a pod is
    made of than ``spec_hash``."""
    if (pod.get("status") or {}).get("phase") in _TERMINAL or pod["metadata"].get(
        "deletionTimestamp"
    ):
        return False  # ended or already going: the round's usual path handles it
    built = (pod["metadata"].get("annotations") or {}).get(POD_SPEC_HASH_ANNOTATION)
    return built is not None and built != spec_hash
