"""OmniPipeline (pure): stages in order, what passes between them, and the batch policy.

A pipeline names OmniStages of one namespace and colocation group, in order; each but the last
says what it hands the next (``Embeds``: it runs as a text encoder and its hidden states become
the next stage's prompt embeds; ``Text``: its output text becomes the next prompt). The router
serves it under its name (``--pipeline`` from :func:`router_flag`).

``spec.batching`` is the policy the operator applies to the pipeline's OnDemand stages when
they cannot be resident together (:mod:`.ondemand`): a stage's held requests ask for the GPU at
once only when ``maxBatch`` of them are held or the oldest has waited ``maxWait``; before that
they are served only where the stage fits beside the awake ones (with room for both: at once,
no swap). ``minResidency`` keeps a stage woken for a batch awake at least that long.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any

from omnistage_operator.api.activation import ActivationError, parse_duration

__all__ = [
    "DEFAULT_MAX_BATCH",
    "DEFAULT_MAX_WAIT_S",
    "PIPELINE_PLURAL",
    "Batching",
    "Pipeline",
    "PipelineError",
    "batching_for",
    "parse_pipeline",
    "pipeline_keys",
    "router_flag",
]

PIPELINE_PLURAL = "omnipipelines"
DEFAULT_MAX_BATCH = 8
DEFAULT_MAX_WAIT_S = 2.0
PASSES = {"Embeds": "embeds", "Text": "text"}


class PipelineError(ValueError):
    """An invalid OmniPipeline field; ``field`` is its dotted path."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class Batching:
    """``spec.batching`` (seconds)."""

    max_batch: int = DEFAULT_MAX_BATCH
    max_wait_s: float = DEFAULT_MAX_WAIT_S
    min_residency_s: float = 0.0

    def due_at(self, held: int, oldest: float) -> float | None:
        """When held requests ask for the GPU at once (None: now, a batch is full)."""
        return None if held >= self.max_batch else oldest + self.max_wait_s


@dataclass(frozen=True)
class Pipeline:
    """One OmniPipeline: ``stages`` in order with what each passes (None: the last)."""

    namespace: str
    name: str
    stages: tuple[tuple[str, str | None], ...]
    batching: Batching

    @property
    def stage_names(self) -> tuple[str, ...]:
        return tuple(s for s, _ in self.stages)


def _seconds(raw: Mapping[str, Any], key: str, default: float, high: float) -> float:
    path = f"spec.batching.{key}"
    if raw.get(key) is None:
        return default
    try:
        seconds = parse_duration(raw[key], path)
    except ActivationError as exc:
        raise PipelineError(path, exc.message) from None
    if seconds > high:
        raise PipelineError(path, f"must be at most {high:g}s, got {raw[key]}")
    return seconds


def parse_batching(raw: Any) -> Batching:
    """``spec.batching`` (defaults: 8 requests, 2s, no residency)."""
    if raw is None:
        return Batching()
    if not isinstance(raw, Mapping):
        raise PipelineError("spec.batching", "must be an object")
    max_batch = raw.get("maxBatch", DEFAULT_MAX_BATCH)
    if not isinstance(max_batch, int) or isinstance(max_batch, bool) or not 1 <= max_batch <= 256:
        raise PipelineError("spec.batching.maxBatch", f"must be 1 to 256, got {max_batch!r}")
    return Batching(
        max_batch=max_batch,
        max_wait_s=_seconds(raw, "maxWait", DEFAULT_MAX_WAIT_S, 3600.0),
        min_residency_s=_seconds(raw, "minResidency", 0.0, 3600.0),
    )


def parse_pipeline(body: Mapping[str, Any], namespace: str | None = None) -> Pipeline:
    """An OmniPipeline body (the CRD refuses most of this first; this is the second check)."""
    meta = body.get("metadata") or {}
    spec = body.get("spec") or {}
    stages_raw = spec.get("stages")
    if not isinstance(stages_raw, list) or not 2 <= len(stages_raw) <= 8:
        raise PipelineError("spec.stages", "must list 2 to 8 stages")
    stages: list[tuple[str, str | None]] = []
    for i, item in enumerate(stages_raw):
        path = f"spec.stages[{i}]"
        if not isinstance(item, Mapping) or not isinstance(item.get("name"), str):
            raise PipelineError(f"{path}.name", "each stage names an OmniStage")
        passes = item.get("passes")
        last = i == len(stages_raw) - 1
        if last and passes is not None:
            raise PipelineError(f"{path}.passes", "the last stage passes nothing on")
        if not last and passes not in PASSES:
            raise PipelineError(f"{path}.passes", f"must be Embeds or Text, got {passes!r}")
        stages.append((item["name"], passes))
    names = [s for s, _ in stages]
    if len(set(names)) != len(names):
        raise PipelineError("spec.stages", "a stage appears twice")
    return Pipeline(
        namespace or meta.get("namespace") or "default",
        str(meta.get("name", "")),
        tuple(stages),
        parse_batching(spec.get("batching")),
    )


def router_flag(pipeline: Pipeline) -> str:
    """The router's ``--pipeline`` value for it."""
    parts = [f"{s}:{PASSES[p]}" if p else s for s, p in pipeline.stages]
    return f"{pipeline.name}={','.join(parts)}"


def pipeline_keys(body: Mapping[str, Any], namespace: str | None) -> dict[Hashable, Any] | None:
    """An OmniPipeline's index entries: under ("stage", namespace, stage) for each stage."""
    ns = namespace or "default"
    stages = (body.get("spec") or {}).get("stages") or []
    names = [s.get("name") for s in stages if isinstance(s, Mapping)]
    keys: list[Hashable] = [("stage", ns, n) for n in names if isinstance(n, str)]
    plain = {k: body[k] for k in ("apiVersion", "kind", "metadata", "spec", "status") if k in body}
    return dict.fromkeys(keys, plain) if keys else None


def batching_for(bodies: list[Mapping[str, Any]], namespace: str) -> Batching | None:
    """The batch policy of a stage from the pipelines naming it (None: in none). A stage in
    several pipelines takes the smallest batch and wait and the longest residency."""
    found: list[Batching] = []
    for body in bodies:
        try:
            found.append(parse_pipeline(body, namespace).batching)
        except PipelineError:
            continue  # the pipeline's status says why; it sets no policy
    if not found:
        return None
    return Batching(
        max_batch=min(b.max_batch for b in found),
        max_wait_s=min(b.max_wait_s for b in found),
        min_residency_s=max(b.min_residency_s for b in found),
    )
