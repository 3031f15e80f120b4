"""The restricted Pod Security Standard admits what omnistage runs: the worker pods the operator
builds and the chart's operator pod, checked by the API server's own PodSecurity admission
(server-side dry run in a namespace that enforces ``restricted``)."""

from __future__ import annotations

import copy
import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from omnistage_operator.api.spec import DesiredState
from omnistage_operator.api.spec_parse import parse_stage
from omnistage_operator.k8s.builders import build_worker_pod, owner_reference
from tests.cluster.controlplane import CommandError, ControlPlane
from tests.unit.test_chart_support import CHART_DIR

ENFORCE = "pod-security.kubernetes.io/enforce"


def restricted_namespace(control_plane: ControlPlane, namespace: str) -> None:
    """Make ``namespace`` enforce the restricted Pod Security Standard (latest version)."""
    control_plane.kubectl("label", "namespace", namespace, f"{ENFORCE}=restricted", "--overwrite")


def _stage(namespace: str, volume: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "omnistage.io/v1alpha1",
        "kind": "OmniStage",
        "metadata": {"name": "llm", "namespace": namespace, "uid": "uid-1", "generation": 1},
        "spec": {
            "runner": "AR",
            "backend": "Transformers",
            "image": "localhost/omnistage-worker:0.1.0",
            "model": {"path": "/models/tiny", "mountPath": "/models", "volume": volume},
            "colocation": {"group": "g1"},
            "placement": {"mode": "Explicit", "nodeName": "n1", "devices": ["gpu0"]},
        },
    }


def _worker_pod(namespace: str, volume: dict[str, Any]) -> dict[str, Any]:
    body = _stage(namespace, volume)
    pod = build_worker_pod(
        parse_stage(body), initial_state=DesiredState.ACTIVE, owner=owner_reference(body)
    )
    del pod["metadata"]["ownerReferences"]  # the owner exists only in this test's imagination
    return pod


def _dry_run(control_plane: ControlPlane, namespace: str, obj: dict[str, Any]) -> str:
    """Create ``obj`` with ``--dry-run=server`` (admission runs, nothing is stored)."""
    try:
        return control_plane.kubectl(
            "create",
            "--dry-run=server",
            "-n",
            namespace,
            "-o",
            "name",
            "-f",
            "-",
            input=json.dumps(obj),
        ).stdout.strip()
    except CommandError as exc:
        return f"refused: {exc.stderr.strip()}"


def test_restricted_namespace_admits_the_worker_pods_the_operator_builds(
    control_plane: ControlPlane, namespace: str
) -> None:
    restricted_namespace(control_plane, namespace)
    pvc = {"persistentVolumeClaim": {"claimName": "models", "readOnly": True}}
    assert _dry_run(control_plane, namespace, _worker_pod(namespace, pvc)) == "pod/llm-worker"
    # the standard is in force: the same pod without the builders' security context is refused
    bare = _worker_pod(namespace, pvc)
    del bare["spec"]["securityContext"], bare["spec"]["containers"][0]["securityContext"]
    refused = _dry_run(control_plane, namespace, bare)
    assert 'violates PodSecurity "restricted:latest"' in refused, refused
    assert "allowPrivilegeEscalation" in refused and "runAsNonRoot" in refused, refused
    # a hostPath model volume (the CPU examples') is the user's choice restricted refuses
    host = {"hostPath": {"path": "/models", "type": "Directory"}}
    refused = _dry_run(control_plane, namespace, _worker_pod(namespace, host))
    assert 'restricted volume type "hostPath"' in refused, refused


def _chart_operator_pod(control_plane: ControlPlane, namespace: str) -> dict[str, Any]:
    """The chart's operator Deployment's pod template, rendered by helm, as a Pod."""
    with tempfile.TemporaryDirectory(prefix="omnistage-values-") as tmp:
        values = Path(tmp) / "values.yaml"
        values.write_text(yaml.safe_dump({"watch": {"namespaces": [namespace]}}))
        rendered = control_plane.helm(
            "template", "omni", str(CHART_DIR), "--namespace", namespace, "--values", str(values)
        ).stdout
    (deployment,) = [d for d in yaml.safe_load_all(rendered) if d and d.get("kind") == "Deployment"]
    template = copy.deepcopy(deployment["spec"]["template"])
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "operator", "labels": template["metadata"].get("labels", {})},
        "spec": template["spec"],
    }


def test_restricted_namespace_admits_the_charts_operator_pod(
    control_plane: ControlPlane, namespace: str
) -> None:
    restricted_namespace(control_plane, namespace)
    pod = _chart_operator_pod(control_plane, namespace)
    account = pod["spec"]["serviceAccountName"]  # admission looks the ServiceAccount up
    control_plane.kubectl("create", "serviceaccount", account, "-n", namespace)
    assert _dry_run(control_plane, namespace, pod) == "pod/operator"


@pytest.fixture(autouse=True)
def _no_stored_pods(control_plane: ControlPlane, namespace: str) -> Any:
    """Dry runs store nothing: the namespace holds no pod afterwards."""
    yield
    assert control_plane.get_json("pods", namespace=namespace)["items"] == []
