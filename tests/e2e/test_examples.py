"""Every object of every example manifest is accepted by the real API server (server-side
dry-run, strict field validation), and the worker pod of each example stage too.

cert-manager's kinds (examples/tls/) need its CRDs, which this cluster lacks; their cross
references are checked in tests/unit/test_examples.py.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from omnistage_operator.api.spec import DesiredState
from omnistage_operator.api.spec_parse import parse_stage
from omnistage_operator.k8s.builders import build_worker_pod, owner_reference
from tests.cluster.controlplane import ControlPlane
from tests.e2e.crd_stage import CRD
from tests.examples import EXAMPLES_DIR, manifest_docs

pytestmark = pytest.mark.cluster

NOT_HERE = ("cert-manager.io/",)


def _dry_run(cp: ControlPlane, namespace: str, obj: dict[str, Any]) -> dict[str, Any]:
    proc = cp.kubectl(
        "create", "--dry-run=server", "--validate=strict", "-n", namespace, "-o", "json",
        "-f", "-", input=json.dumps(obj), check=False,
    )  # fmt: skip
    assert proc.returncode == 0, f"{obj['kind']} {obj['metadata']['name']}: {proc.stderr}"
    data: dict[str, Any] = json.loads(proc.stdout)
    return data


def test_every_example_object_is_accepted(control_plane: ControlPlane, namespace: str) -> None:
    control_plane.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD))
    control_plane.wait_crd_established("omnistages.omnistage.io")
    pipelines = CRD.parent / "omnipipelines.omnistage.io.yaml"
    control_plane.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(pipelines))
    control_plane.wait_crd_established("omnipipelines.omnistage.io")
    checked: set[str] = set()
    for path, doc in manifest_docs():
        if doc["apiVersion"].startswith(NOT_HERE):
            continue
        stored = _dry_run(control_plane, namespace, doc)
        checked.add(doc["kind"])
        if doc["kind"] != "OmniStage":
            continue
        stored["metadata"]["uid"] = stored["metadata"].get("uid") or "dry-run"
        stage = parse_stage(stored)
        pod = build_worker_pod(
            stage, initial_state=DesiredState.ACTIVE, owner=owner_reference(stored)
        )
        pod["metadata"]["ownerReferences"] = []  # the owner was a dry run
        _dry_run(control_plane, namespace, pod)
        assert path.is_relative_to(EXAMPLES_DIR)
    assert {"OmniStage", "OmniPipeline", "PersistentVolumeClaim"} <= checked
