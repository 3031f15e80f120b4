"""OmniPipeline status, metrics and Events, from the group rounds that move its stages.

After each round of a group, every pipeline with a stage in it gets: its stages (state, held
and in-flight requests: the queue per stage), ``batches`` (wakes of its stages: each serves the
batch its held requests formed), ``swaps`` (rounds that put one of its stages to sleep and
woke another: a hand-over inside the pipeline), ``observedGeneration`` and a ``Ready``
condition (every stage exists in one colocation group). The counters continue from what status
says when a new leader takes over. A swap is an Event on the pipeline and both counters are
Prometheus counters.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kr8s.asyncio.objects import new_class
from prometheus_client import Counter

from omnistage_operator.api.pipelines import Pipeline, PipelineError, parse_pipeline
from omnistage_operator.decisions.arbiter import WorkerPhase
from omnistage_operator.decisions.handover import RoundOutcome
from omnistage_operator.decisions.status import format_timestamp
from omnistage_operator.k8s.kube import Kind, Kube, KubeError

__all__ = [
    "OmniPipeline",
    "PipelineStatus",
    "RoundMoves",
    "after_group_round",
    "moves_of",
    "status_body",
]

log = logging.getLogger(__name__)

OmniPipeline: Kind = new_class("OmniPipeline", "omnistage.io/v1alpha1", namespaced=True)
PIPELINE_SWAPS = Counter(
    "omnistage_pipeline_swaps_total",
    "Hand-overs between the stages of a pipeline (one stage put to sleep, another woken).",
    ["namespace", "pipeline"],
)
PIPELINE_BATCHES = Counter(
    "omnistage_pipeline_batches_total",
    "Wakes of a pipeline's stages (each serves the batch of requests held for it).",
    ["namespace", "pipeline"],
)
Emit = Callable[..., None]


@dataclass(frozen=True)
class StageView:
    """One stage as the round saw it."""

    phase: WorkerPhase | None  # None: no such OmniStage in the group
    held: int = 0
    inflight: int = 0
    group: str | None = None
    kind: tuple[str, str] = ("", "")  # spec.runner, spec.backend


def kind_misfits(pipeline: Pipeline, stages: Mapping[str, StageView]) -> list[str]:
    """Stages whose runner cannot do what the pipeline asks of them (pure)."""
    out: list[str] = []
    names = pipeline.stage_names
    for i, (name, passes) in enumerate(pipeline.stages[:-1]):
        runner, backend = stages[name].kind if name in stages else ("", "")
        after = stages[names[i + 1]].kind[0] if names[i + 1] in stages else ""
        if passes == "Embeds" and (runner, backend) != ("AR", "Transformers"):
            out.append(
                f"{name} passes Embeds: an AR Transformers stage encodes, not {runner} {backend}"
            )
        elif passes == "Embeds" and after and after != "Diffusion":
            out.append(f"{names[i + 1]} takes {name}'s embeds: a Diffusion stage does, not {after}")
        elif passes == "Text" and runner and runner != "AR":
            out.append(f"{name} passes Text: an AR stage writes text, not {runner}")
    return out


@dataclass(frozen=True)
class RoundMoves:
    """What one round did to a pipeline's stages."""

    slept: tuple[str, ...]
    woke: tuple[str, ...]

    @property
    def swapped(self) -> bool:
        return bool(self.slept and self.woke)


def moves_of(pipeline: Pipeline, outcome: RoundOutcome) -> RoundMoves:
    """Its stages put to sleep (memory released) and woken (ok ACKs) by the round."""
    names = set(pipeline.stage_names)
    slept = tuple(
        s.order.stage
        for s in outcome.sleeps
        if s.ok and s.order.stage in names and s.order.releases_memory and not s.order.components
    )
    woke = tuple(n for n, ack in outcome.wakes.items() if ack.ok and n in names)
    return RoundMoves(slept, woke)


def status_body(
    pipeline: Pipeline,
    stages: Mapping[str, StageView],
    swaps: int,
    batches: int,
    *,
    generation: int | None,
    now: float,
) -> dict[str, Any]:
    """The pipeline's ``status`` (pure)."""
    missing = [n for n in pipeline.stage_names if stages.get(n, StageView(None)).phase is None]
    groups = {stages[n].group for n in pipeline.stage_names if n not in missing}
    if missing:
        ready, reason, message = "False", "StageMissing", f"no OmniStage {', '.join(missing)}"
    elif len(groups) > 1:
        ready, reason = "False", "GroupsDiffer"
        message = f"the stages are in colocation groups {sorted(g or '' for g in groups)}"
    elif misfits := kind_misfits(pipeline, stages):
        ready, reason, message = "False", "StageKindMismatch", "; ".join(misfits)
    else:
        ready, reason, message = "True", "StagesFound", "every stage is in one colocation group"
    return {
        "observedGeneration": generation,
        "stages": [
            {
                "name": n,
                "state": (stages.get(n) or StageView(None)).phase,
                "heldRequests": (stages.get(n) or StageView(None)).held,
                "inflightRequests": (stages.get(n) or StageView(None)).inflight,
            }
            for n in pipeline.stage_names
        ],
        "swaps": swaps,
        "batches": batches,
        "conditions": [
            {
                "type": "Ready",
                "status": ready,
                "reason": reason,
                "message": message,
                "observedGeneration": generation,
                "lastTransitionTime": format_timestamp(now),
            }
        ],
    }


@dataclass
class _Counts:
    swaps: int = 0
    batches: int = 0
    written: dict[str, Any] = field(default_factory=dict)


def _same(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Equal but for the conditions' transition times."""

    def bare(s: Mapping[str, Any]) -> Any:
        conds = [{k: v for k, v in c.items() if k != "lastTransitionTime"} for c in s["conditions"]]
        return {**s, "conditions": conds}

    return bool(a) and bool(b) and bare(a) == bare(b)


class PipelineStatus:
    """Counters per pipeline (continued from status) and the status writes."""

    def __init__(self, kube: Kube, emit: Emit) -> None:
        self.kube = kube
        self.emit = emit
        self.counts: dict[tuple[str, str], _Counts] = {}

    async def after_round(
        self,
        namespace: str,
        bodies: list[Mapping[str, Any]],
        stages: Mapping[str, StageView],
        outcome: RoundOutcome | None,
        *,
        now: float,
        woken_for: Mapping[str, int] | None = None,
    ) -> None:
        """Count what the round did and write each pipeline's status when it changed
        (``woken_for``: the held requests the round saw per stage, for the Event)."""
        for body in bodies:
            meta = body.get("metadata") or {}
            try:
                pipeline = parse_pipeline(body, namespace)
            except PipelineError as exc:
                log.warning("pipeline %s/%s: %s", namespace, meta.get("name"), exc)
                continue
            key = (namespace, pipeline.name)
            counts = self.counts.get(key)
            if counts is None:
                seen = body.get("status") or {}
                counts = self.counts[key] = _Counts(
                    int(seen.get("swaps") or 0), int(seen.get("batches") or 0)
                )
            if outcome is not None:
                moves = moves_of(pipeline, outcome)
                self._count(body, pipeline, counts, moves, woken_for or {})
            status = status_body(
                pipeline,
                stages,
                counts.swaps,
                counts.batches,
                generation=meta.get("generation"),
                now=now,
            )
            if _same(status, counts.written):
                continue
            try:
                await self.kube.merge_patch(
                    OmniPipeline, namespace, pipeline.name, {"status": status}, status=True
                )
                counts.written = status
            except KubeError as exc:
                log.warning("pipeline %s/%s status not written: %s", *key, exc)

    def forget(self, namespace: str, name: str) -> None:
        """A deleted pipeline: drop its counters and series."""
        self.counts.pop((namespace, name), None)
        PIPELINE_SWAPS.remove(namespace, name)
        PIPELINE_BATCHES.remove(namespace, name)

    def _count(
        self,
        body: Mapping[str, Any],
        pipeline: Pipeline,
        counts: _Counts,
        moves: RoundMoves,
        woken_for: Mapping[str, int],
    ) -> None:
        ns, name = pipeline.namespace, pipeline.name
        if moves.woke:
            counts.batches += len(moves.woke)
            PIPELINE_BATCHES.labels(ns, name).inc(len(moves.woke))
        if moves.swapped:
            counts.swaps += 1
            PIPELINE_SWAPS.labels(ns, name).inc()
            held = sum(woken_for.get(n, 0) for n in moves.woke)
            self.emit(
                {"apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline", **body},
                "Swapped",
                f"{', '.join(moves.slept)} asleep, {', '.join(moves.woke)} woken for "
                f"{held} held requests (swap {counts.swaps}, batch {counts.batches})",
            )


async def after_group_round(runner: Any, port: Any, outcome: RoundOutcome | None) -> None:
    """The pipelines with a stage in ``port``'s group, after its round (``runner``: the
    GroupRunner, with ``views``, ``demand`` and ``pipeline_status``)."""
    bodies = runner.views.pipelines(port.ns, list(port.specs))
    if not bodies:
        return
    names = {
        str(s.get("name"))
        for b in bodies
        for s in (b.get("spec") or {}).get("stages") or []
        if isinstance(s, Mapping)
    }
    stages: dict[str, StageView] = {}
    for name in names:
        body = runner.views.stage(port.ns, name)
        if body is None:
            continue
        report = runner.demand.report(port.ns, name)
        fact = port.facts.get(name)
        if fact is not None:
            phase = fact.phase
        else:
            seen = (body.get("status") or {}).get("state")
            phase = WorkerPhase(seen) if seen in set(WorkerPhase) else WorkerPhase.ABSENT
        stages[name] = StageView(
            phase,
            report.demand.held if report is not None else 0,
            report.demand.inflight if report is not None else 0,
            ((body.get("spec") or {}).get("colocation") or {}).get("group"),
            (str((body.get("spec") or {}).get("runner", "")), str(body["spec"].get("backend", ""))),
        )
    asked = getattr(port, "demand_asked", {})
    woken_for = {n: int(asked[n][0]) for n in names if n in asked}
    await runner.pipeline_status.after_round(
        port.ns, bodies, stages, outcome, now=time.time(), woken_for=woken_for
    )
