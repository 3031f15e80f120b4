"""An OmniStage body for the builder tests, the stage and owner reference the builders take from
it, and the one container of a built pod."""

from __future__ import annotations

from typing import Any

from omnistage_operator.api.spec import StageSpec
from omnistage_operator.api.spec_parse import parse_stage
from omnistage_operator.k8s.builders import owner_reference


def stage_body(**spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "apiVersion": "omnistage.io/v1alpha1",
        "kind": "OmniStage",
        "metadata": {"name": "llm", "namespace": "ml", "uid": "uid-123", "generation": 4},
        "spec": {
            "runner": "AR",
            "backend": "Transformers",
            "model": {
                "path": "/models/tiny-llama",
                "volume": {"hostPath": {"path": "/data/models", "type": "Directory"}},
            },
            "image": "omnistage-worker:dev",
            "colocation": {"group": "g1", "priority": 5},
        },
    }
    body["spec"].update(spec)
    return body


def make(**spec: Any) -> tuple[StageSpec, dict[str, Any]]:
    body = stage_body(**spec)
    return parse_stage(body), owner_reference(body)


def container(pod: dict[str, Any]) -> dict[str, Any]:
    (c,) = pod["spec"]["containers"]
    assert isinstance(c, dict)
    return c
