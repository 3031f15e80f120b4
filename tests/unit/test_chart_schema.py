"""values.schema.json refuses unknown keys and bad values with a message naming the key."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from tests.unit.test_chart_support import CHART_DIR, Obj, render, render_error

SCHEMA: Obj = json.loads((CHART_DIR / "values.schema.json").read_text())


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"replicas": 2}, "replicas"),
        ({"leaderElection": {"leaseName": "x"}}, "leaseName"),
        ({"image": {"registry": "x"}}, "registry"),
        ({"rbac": {"clusterWide": True}}, "clusterWide"),
        ({"networkPolicy": {"ingress": []}}, "ingress"),
        ({"metrics": {"serviceMonitor": {"namespace": "x"}}}, "namespace"),
        ({"networkPolicy": {"extraIngressFrom": [{"podSelectr": {}}]}}, "podSelectr"),
        ({"resources": {"requests": {"gpu": "1"}}}, "gpu"),
    ],
    ids=lambda v: json.dumps(v) if isinstance(v, dict) else str(v),
)
def test_unknown_keys_are_refused(values: Obj, named: str) -> None:
    err = render_error(values)
    assert "schema" in err
    assert named in err, err


@pytest.mark.parametrize(
    ("values", "at"),
    [
        ({"rbac": {"scope": "Everywhere"}}, "/rbac/scope"),
        ({"operator": {"placement": "magic"}}, "/operator/placement"),
        ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
        ({"image": {"digest": "sha256:abc"}}, "/image/digest"),
        ({"ports": {"metrics": 80}}, "/ports/metrics"),
        ({"ports": {"liveness": 70000}}, "/ports/liveness"),
        ({"operator": {"ackRetries": 0}}, "/operator/ackRetries"),
        ({"operator": {"sleepTimeoutSeconds": "60"}}, "/operator/sleepTimeoutSeconds"),
        ({"operator": {"roundWaitSeconds": 0}}, "/operator/roundWaitSeconds"),
        ({"operator": {"roundWaitSeconds": 601}}, "/operator/roundWaitSeconds"),
        ({"operator": {"handoffHostPath": "relative/dir"}}, "/operator/handoffHostPath"),
        ({"watch": {"namespaces": ["Not_A_Namespace"]}}, "/watch/namespaces/0"),
        ({"networkPolicy": {"workerPorts": []}}, "/networkPolicy/workerPorts"),
        (
            {"metrics": {"serviceMonitor": {"interval": "often"}}},
            "/metrics/serviceMonitor/interval",
        ),
        ({"tolerations": [{"operator": "Maybe"}]}, "/tolerations/0/operator"),
        ({"operator": {"extraArgs": ["standalone"]}}, "/operator/extraArgs/0"),
        ({"replicaCount": 0}, "/replicaCount"),
        ({"leaderElection": {"leaseDuration": 0}}, "/leaderElection/leaseDuration"),
        ({"leaderElection": {"retryPeriod": "2s"}}, "/leaderElection/retryPeriod"),
    ],
    ids=lambda v: json.dumps(v) if isinstance(v, dict) else str(v),
)
def test_bad_values_are_refused_naming_the_key(values: Obj, at: str) -> None:
    err = render_error(values)
    assert at in err, err


def _objects(node: Any, path: str = "") -> Iterator[tuple[str, Obj]]:
    if isinstance(node, dict):
        if node.get("type") == "object" or "properties" in node:
            yield path, node
        for key, child in node.items():
            yield from _objects(child, f"{path}/{key}")
    elif isinstance(node, list):
        for i, child in enumerate(node):
            yield from _objects(child, f"{path}/{i}")


# Kubernetes objects passed through unchanged: their own API server validates them.
PASS_THROUGH = {
    "/properties/affinity",
    "/properties/global",
    "/definitions/envVar/properties/valueFrom",
}


def test_every_schema_object_refuses_unknown_keys() -> None:
    for path, node in _objects(SCHEMA):
        if path in PASS_THROUGH:
            continue
        assert "additionalProperties" in node, f"{path} accepts any key"
        extra = node["additionalProperties"]
        # Either closed, or a map whose values are typed (labels, annotations, nodeSelector).
        assert extra is False or (isinstance(extra, dict) and "type" in extra), path


def _keys(node: Any, prefix: str = "") -> set[str]:
    if not isinstance(node, dict) or not node:
        return {prefix} if prefix else set()
    keys: set[str] = set()
    for key, value in node.items():
        keys |= _keys(value, f"{prefix}.{key}" if prefix else key)
    return keys


def _schema_keys(node: Obj, prefix: str = "") -> set[str]:
    keys: set[str] = set()
    props = node.get("properties")
    if not props:
        return {prefix} if prefix else set()
    for key, child in props.items():
        keys |= _schema_keys(child, f"{prefix}.{key}" if prefix else key)
    return keys


def test_schema_and_values_describe_the_same_keys() -> None:
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    schema_keys = _schema_keys(SCHEMA) - {"global"}
    value_keys = _keys(values)
    # Every value has a schema entry; free maps (e.g. podAnnotations: {}) are leaves in both.
    free = ("resources.", "router.resources")
    assert value_keys <= schema_keys | {k for k in value_keys if k.startswith(free)}
    assert {k.split(".")[0] for k in schema_keys} == {k.split(".")[0] for k in value_keys}


def test_every_value_is_documented() -> None:
    """Each leaf value in values.yaml has a comment line right above it (resources excepted)."""
    lines = (CHART_DIR / "values.yaml").read_text().splitlines()
    section = ""
    for i, line in enumerate(lines):
        stripped = line.strip()
        if not stripped or stripped.startswith(("#", "- ")):
            continue
        if not line.startswith(" "):
            section = stripped.split(":")[0]
        if stripped.endswith(":") or (section == "resources" and line.startswith(" ")):
            continue  # a heading of nested keys, or the resource quantities
        assert lines[i - 1].strip().startswith("#"), (
            f"values.yaml:{i + 1} {stripped!r} lacks a comment"
        )


def test_defaults_render() -> None:
    assert render()
