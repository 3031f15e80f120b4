"""Child-object builders produce exactly the contract's shapes: the pod, the Service, the group's
claim, the token Secret, and the pod-spec hash."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from omnistage_operator.api.spec import DesiredState
from omnistage_operator.k8s.builders import (
    build_group_claim,
    build_service,
    build_worker_pod,
    claim_name,
    owner_reference,
    pod_claim_name,
    pod_name,
    service_name,
)
from omnistage_operator.k8s.pod_hash import pod_spec_hash
from omnistage_operator.k8s.token_secret import TOKEN_SHA256_ANNOTATION, build_token_secret
from tests.unit.stage_bodies import container, make, stage_body

TOKEN = "s3cr3t-token-value-7f9a"


LABELS = {
    "app.kubernetes.io/name": "omnistage-worker",
    "app.kubernetes.io/instance": "llm",
    "app.kubernetes.io/managed-by": "omnistage-operator",
    "omnistage.io/stage": "llm",
    "omnistage.io/group": "g1",
}


def test_names() -> None:
    assert pod_name("llm") == "llm-worker"
    assert service_name("llm") == "llm-worker"
    assert claim_name("g1") == "omnistage-g1-gpus"


def test_owner_reference() -> None:
    assert owner_reference(stage_body()) == {
        "apiVersion": "omnistage.io/v1alpha1",
        "kind": "OmniStage",
        "name": "llm",
        "uid": "uid-123",
        "controller": True,
        "blockOwnerDeletion": True,
    }
    with pytest.raises(ValueError, match="uid"):
        owner_reference({"metadata": {"name": "x"}})


def test_dra_pod_shape() -> None:
    stage, owner = make()
    pod = build_worker_pod(stage, initial_state=DesiredState.ACTIVE, owner=owner)
    meta = pod["metadata"]
    assert pod["apiVersion"] == "v1" and pod["kind"] == "Pod"
    assert meta["name"] == "llm-worker" and meta["namespace"] == "ml"
    assert meta["labels"] == LABELS
    assert meta["ownerReferences"] == [owner]
    assert meta["annotations"]["omnistage.io/initial-state"] == "Active"
    assert meta["annotations"]["omnistage.io/spec-generation"] == "4"
    spec = pod["spec"]
    assert spec["terminationGracePeriodSeconds"] == 30
    assert spec["restartPolicy"] == "Never"
    assert spec["resourceClaims"] == [{"name": "gpus", "resourceClaimName": "omnistage-g1-gpus"}]
    assert "nodeName" not in spec
    c = container(pod)
    assert c["name"] == "worker" and c["image"] == "omnistage-worker:dev"
    assert c["command"] == ["omnistage-worker"]
    assert c["resources"] == {"claims": [{"name": "gpus"}]}
    assert c["ports"] == [
        {"name": "grpc", "containerPort": 50051, "protocol": "TCP"},
        {"name": "http", "containerPort": 8000, "protocol": "TCP"},
        {"name": "metrics", "containerPort": 9464, "protocol": "TCP"},
    ]
    assert c["readinessProbe"]["grpc"] == {
        "port": 50051,
        "service": "omnistage.worker.v1.SleepService",
    }
    assert c["livenessProbe"]["grpc"] == {"port": 50051, "service": ""}
    assert c["terminationMessagePolicy"] == "FallbackToLogsOnError"
    env = {e["name"]: e for e in c["env"]}
    assert list(env) == ["POD_IP", "POD_NAME", "POD_NAMESPACE", "NODE_NAME", "OMNISTAGE_STAGE"]
    for name, path in [
        ("POD_IP", "status.podIP"),
        ("POD_NAME", "metadata.name"),
        ("POD_NAMESPACE", "metadata.namespace"),
        ("NODE_NAME", "spec.nodeName"),
    ]:
        assert env[name]["valueFrom"]["fieldRef"]["fieldPath"] == path
    assert env["OMNISTAGE_STAGE"] == {"name": "OMNISTAGE_STAGE", "value": "llm"}
    assert c["volumeMounts"] == [
        {"name": "omnistage-token", "mountPath": "/var/run/secrets/omnistage", "readOnly": True},
        {"name": "model", "mountPath": "/models", "readOnly": True},
    ]
    assert spec["volumes"] == [
        {
            "name": "omnistage-token",
            "secret": {
                "secretName": "omnistage-worker-token",
                "items": [{"key": "token", "path": "token"}],
                "defaultMode": 0o400,
            },
        },
        {"name": "model", "hostPath": {"path": "/data/models", "type": "Directory"}},
    ]
    assert spec["automountServiceAccountToken"] is False


def test_explicit_pod_shape() -> None:
    stage, owner = make(
        placement={"mode": "Explicit", "nodeName": "gpu-node-1", "devices": ["0", "3"]}, gpus=2
    )
    pod = build_worker_pod(stage, initial_state=DesiredState.ASLEEP, owner=owner)
    assert pod_claim_name(stage) is None
    assert pod["spec"]["nodeName"] == "gpu-node-1"
    assert "resourceClaims" not in pod["spec"]
    c = container(pod)
    assert "resources" not in c
    env = {e["name"]: e for e in c["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == {"name": "NVIDIA_VISIBLE_DEVICES", "value": "0,3"}
    with pytest.raises(ValueError, match="Explicit"):
        build_worker_pod(stage, initial_state=DesiredState.ACTIVE, owner=owner, claim_name="x")


def test_claim_name_override_and_none() -> None:
    stage, owner = make()
    pod = build_worker_pod(stage, initial_state=DesiredState.ACTIVE, owner=owner, claim_name=None)
    assert "resourceClaims" not in pod["spec"] and "resources" not in container(pod)
    pod = build_worker_pod(stage, initial_state=DesiredState.ACTIVE, owner=owner, claim_name="c")
    assert pod["spec"]["resourceClaims"] == [{"name": "gpus", "resourceClaimName": "c"}]


def test_zero_gpus_has_no_claim() -> None:
    stage, owner = make(gpus=0)
    assert pod_claim_name(stage) is None
    pod = build_worker_pod(stage, initial_state=DesiredState.ACTIVE, owner=owner)
    assert "resourceClaims" not in pod["spec"]


def test_no_model_volume_means_no_model_mount() -> None:
    stage, owner = make(model={"path": "/opt/model"})
    pod = build_worker_pod(stage, initial_state=DesiredState.ACTIVE, owner=owner)
    assert [v["name"] for v in pod["spec"]["volumes"]] == ["omnistage-token"]
    assert [m["name"] for m in container(pod)["volumeMounts"]] == ["omnistage-token"]


def test_template_overrides_are_merged() -> None:
    stage, owner = make(
        template={
            "resources": {"limits": {"memory": "8Gi"}, "requests": {"cpu": "1"}},
            "env": [{"name": "HF_HUB_OFFLINE", "value": "1"}],
            "volumes": [{"name": "cache", "emptyDir": {}}],
            "volumeMounts": [{"name": "cache", "mountPath": "/cache"}],
            "nodeSelector": {"nvidia.com/gpu.product": "H100"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
            "annotations": {"team": "vision"},
            "labels": {"cost-center": "42"},
            "serviceAccountName": "models",
            "priorityClassName": "high",
        }
    )
    pod = build_worker_pod(stage, initial_state=DesiredState.ACTIVE, owner=owner)
    c, spec, meta = container(pod), pod["spec"], pod["metadata"]
    assert c["resources"] == {
        "limits": {"memory": "8Gi"},
        "requests": {"cpu": "1"},
        "claims": [{"name": "gpus"}],
    }
    assert c["env"][-1] == {"name": "HF_HUB_OFFLINE", "value": "1"}
    assert [e["name"] for e in c["env"]][:5] == [
        "POD_IP", "POD_NAME", "POD_NAMESPACE", "NODE_NAME", "OMNISTAGE_STAGE",
    ]  # fmt: skip
    assert [v["name"] for v in spec["volumes"]] == ["omnistage-token", "model", "cache"]
    assert c["volumeMounts"][-1] == {"name": "cache", "mountPath": "/cache"}
    assert spec["nodeSelector"] == {"nvidia.com/gpu.product": "H100"}
    assert spec["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists"}]
    assert spec["serviceAccountName"] == "models"
    assert "automountServiceAccountToken" not in spec
    assert spec["priorityClassName"] == "high"
    assert meta["annotations"]["team"] == "vision"
    assert meta["labels"] == {"cost-center": "42", **LABELS}


def test_builders_do_not_alias_the_spec() -> None:
    stage, owner = make(template={"env": [{"name": "A", "value": "1"}]})
    pod = build_worker_pod(stage, initial_state=DesiredState.ACTIVE, owner=owner)
    container(pod)["env"][-1]["value"] = "mutated"
    pod["spec"]["volumes"][1]["hostPath"]["path"] = "/elsewhere"
    again = build_worker_pod(stage, initial_state=DesiredState.ACTIVE, owner=owner)
    assert container(again)["env"][-1]["value"] == "1"
    assert again["spec"]["volumes"][1]["hostPath"]["path"] == "/data/models"


def test_service_shape() -> None:
    stage, owner = make(worker={"port": 6000})
    svc = build_service(stage, owner=owner)
    assert svc["apiVersion"] == "v1" and svc["kind"] == "Service"
    assert svc["metadata"] == {
        "name": "llm-worker",
        "namespace": "ml",
        "labels": LABELS,
        "ownerReferences": [owner],
    }
    assert svc["spec"]["type"] == "ClusterIP"
    assert svc["spec"]["selector"] == {
        "app.kubernetes.io/name": "omnistage-worker",
        "omnistage.io/stage": "llm",
    }
    assert svc["spec"]["ports"] == [
        {
            "name": "grpc",
            "port": 6000,
            "targetPort": 6000,
            "protocol": "TCP",
            "appProtocol": "grpc",
        },
        {
            "name": "http",
            "port": 8000,
            "targetPort": 8000,
            "protocol": "TCP",
            "appProtocol": "http",
        },
    ]
    # The selector picks exactly this stage's pod.
    pod = build_worker_pod(stage, initial_state=DesiredState.ACTIVE, owner=owner)
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()


def test_group_claim_shape() -> None:
    claim = build_group_claim("ml", "g1", 2)
    assert claim == {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {
            "name": "omnistage-g1-gpus",
            "namespace": "ml",
            "labels": {
                "app.kubernetes.io/name": "omnistage-gpus",
                "app.kubernetes.io/managed-by": "omnistage-operator",
                "omnistage.io/group": "g1",
            },
        },
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "gpus",
                        "exactly": {
                            "deviceClassName": "gpu.nvidia.com",
                            "allocationMode": "ExactCount",
                            "count": 2,
                        },
                    }
                ]
            }
        },
    }
    other = build_group_claim("ml", "g1", 1, device_class="gpu.example.com")
    assert other["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] == (
        "gpu.example.com"
    )
    assert "ownerReferences" not in claim["metadata"]
    with pytest.raises(ValueError):
        build_group_claim("ml", "g1", 0)


def test_token_secret() -> None:
    secret = build_token_secret("ml", TOKEN)
    assert secret["metadata"]["name"] == "omnistage-worker-token"
    assert secret["type"] == "Opaque"
    assert base64.b64decode(secret["data"]["token"]).decode() == TOKEN
    assert len(secret["metadata"]["annotations"][TOKEN_SHA256_ANNOTATION]) == 64
    with pytest.raises(ValueError):
        build_token_secret("ml", "")


def test_token_value_never_in_pod_or_service() -> None:
    stage, owner = make(template={"env": [{"name": "X", "value": "y"}]})
    encoded = base64.b64encode(TOKEN.encode()).decode()
    for obj in (
        build_worker_pod(stage, initial_state=DesiredState.ACTIVE, owner=owner),
        build_worker_pod(stage, initial_state=DesiredState.ASLEEP, owner=owner, sleep_level=2),
        build_service(stage, owner=owner),
        build_group_claim("ml", "g1", 1),
    ):
        text = json.dumps(obj)
        assert TOKEN not in text and encoded not in text


def test_pod_spec_hash_tracks_only_restart_fields() -> None:
    base, owner = make()
    h = pod_spec_hash(base)
    assert len(h) == 16 and int(h, 16) >= 0
    pod = build_worker_pod(base, initial_state=DesiredState.ACTIVE, owner=owner)
    assert pod["metadata"]["annotations"]["omnistage.io/pod-spec-hash"] == h
    same: list[dict[str, Any]] = [
        {"state": "Asleep"},
        {"sleepLevel": 2},
        {"colocation": {"group": "g1", "priority": 99}},
        {"vram": {"request": "1Gi"}},
    ]
    for change in same:
        assert pod_spec_hash(make(**change)[0]) == h, change
    different: list[dict[str, Any]] = [
        {"image": "other:1"},
        {"gpus": 2},
        {"colocation": {"group": "g2", "priority": 5}},
        {"worker": {"args": ["--x"]}},
        {"worker": {"port": 6000}},
        {"template": {"env": [{"name": "A", "value": "1"}]}},
        {"template": {"labels": {"a": "b"}}},
        {"placement": {"mode": "Explicit", "nodeName": "n", "devices": ["0"]}},
        {"model": {"path": "/models/other", "volume": {"emptyDir": {}}}},
    ]
    hashes = {pod_spec_hash(make(**change)[0]) for change in different}
    assert h not in hashes and len(hashes) == len(different)
