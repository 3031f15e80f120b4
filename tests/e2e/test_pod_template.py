"""``spec.template``'s pod fields on the real API server: the CRD refuses bad ones naming the
field, and the pod the builders make from them is admitted, also in a namespace that enforces
the ``restricted`` Pod Security Standard (the default security context is enough).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from omnistage_operator.api.spec import DesiredState
from omnistage_operator.api.spec_parse import parse_stage
from omnistage_operator.k8s.builders import build_worker_pod, owner_reference
from tests.cluster.controlplane import ControlPlane
from tests.e2e.crd_stage import CRD, Mutation, _set, apply, get, good

pytestmark = pytest.mark.cluster

FULL_TEMPLATE: dict[str, Any] = {
    "securityContext": {"runAsUser": 65532, "fsGroup": 1000},
    "containerSecurityContext": {"readOnlyRootFilesystem": True},
    "imagePullSecrets": [{"name": "registry-credentials"}],
    "affinity": {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h200"]}]}
                ]
            }
        }
    },
    "topologySpreadConstraints": [
        {
            "maxSkew": 1,
            "topologyKey": "kubernetes.io/hostname",
            "whenUnsatisfiable": "ScheduleAnyway",
        }
    ],
    "runtimeClassName": "nvidia",
    "envFrom": [
        {"configMapRef": {"name": "tuning"}},
        {"secretRef": {"name": "hub"}, "prefix": "HF_"},
    ],
    "initContainers": [
        {
            "name": "warm-cache",
            "image": "busybox:1.36",
            "command": ["true"],
            "securityContext": {
                "allowPrivilegeEscalation": False,
                "capabilities": {"drop": ["ALL"]},
            },
        }
    ],
    "shmSize": "8Gi",
}

BAD: list[tuple[str, Mutation, tuple[str, ...]]] = [
    (
        "init-named-worker",
        _set("spec.template.initContainers", [{"name": "worker", "image": "x"}]),
        ("spec.template.initContainers[0].name", "operator's containers"),
    ),
    (
        "init-without-image",
        _set("spec.template.initContainers", [{"name": "fetch"}]),
        ("spec.template.initContainers[0].image", "Required value"),
    ),
    (
        "env-from-both",
        _set(
            "spec.template.envFrom",
            [{"configMapRef": {"name": "a"}, "secretRef": {"name": "b"}}],
        ),
        ("spec.template.envFrom[0]", "exactly one of configMapRef and secretRef"),
    ),
    (
        "shm-not-a-quantity",
        _set("spec.template.shmSize", "lots"),
        ("spec.template.shmSize", "positive quantity"),
    ),
    ("shm-zero", _set("spec.template.shmSize", 0), ("spec.template.shmSize", "positive quantity")),
    (
        "shm-mounted-twice",
        _set(
            "spec.template",
            {
                "shmSize": "1Gi",
                "volumes": [{"name": "s", "emptyDir": {}}],
                "volumeMounts": [{"name": "s", "mountPath": "/dev/shm"}],
            },
        ),
        ("spec.template.volumeMounts", "must not mount /dev/shm"),
    ),
    (
        "shm-volume-name",
        _set("spec.template.volumes", [{"name": "omnistage-shm", "emptyDir": {}}]),
        ("spec.template.volumes[0].name", "omnistage-shm"),
    ),
    (
        "spread-without-when",
        _set("spec.template.topologySpreadConstraints", [{"maxSkew": 1, "topologyKey": "zone"}]),
        ("spec.template.topologySpreadConstraints[0].whenUnsatisfiable", "Required value"),
    ),
    (
        "runtime-class-pattern",
        _set("spec.template.runtimeClassName", "NVIDIA_runtime"),
        ("spec.template.runtimeClassName", "should match"),
    ),
    (
        "pull-secret-without-name",
        _set("spec.template.imagePullSecrets", [{}]),
        ("spec.template.imagePullSecrets[0].name", "Required value"),
    ),
    # spec.worker.tls and spec.model.source
    (
        "tls-flag-in-args",
        _set("spec.worker.args", ["--tls-cert=/etc/cert.pem"]),
        ("spec.worker.args", "--tls-cert, --tls-key, --health-port"),
    ),
    (
        "health-port-is-the-grpc-port",
        _set("spec.worker", {"healthPort": 50051, "tls": {"secretName": "cert"}}),
        ("spec.worker.healthPort", "must differ from spec.worker.port"),
    ),
    (
        "tls-secret-name",
        _set("spec.worker.tls", {"secretName": "Not_A_Name"}),
        ("spec.worker.tls.secretName", "should match"),
    ),
    (
        "tls-volume-name",
        _set("spec.template.volumes", [{"name": "omnistage-tls", "emptyDir": {}}]),
        ("spec.template.volumes[0].name", "omnistage-tls"),
    ),
    (
        "source-repo",
        _set("spec.model.source", {"hub": {"url": "https://hub.example", "repo": "nope"}}),
        ("spec.model.source.hub.repo", "should match"),
    ),
    (
        "source-without-hub-or-s3",
        _set("spec.model.source", {}),
        ("spec.model.source", "must set exactly one of hub and s3"),
    ),
    (
        "source-path-outside-the-mount",
        _set(
            "spec.model",
            {
                "path": "/elsewhere/m",
                "source": {"hub": {"url": "https://h.example", "repo": "a/b"}},
            },
        ),
        ("spec.model.path", "must be under spec.model.mountPath"),
    ),
]


@pytest.fixture
def cluster(control_plane: ControlPlane) -> ControlPlane:
    control_plane.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD))
    control_plane.wait_crd_established(CRD.stem)
    return control_plane


@pytest.mark.parametrize(("case", "mutate", "needles"), BAD, ids=[b[0] for b in BAD])
def test_bad_pod_field_is_refused_naming_it(
    cluster: ControlPlane, namespace: str, case: str, mutate: Mutation, needles: tuple[str, ...]
) -> None:
    manifest = good(f"bad-{case}")
    mutate(manifest)
    proc = apply(cluster, namespace, manifest, check=False)
    assert proc.returncode != 0, f"{case}: accepted, but should be refused:\n{proc.stdout}"
    for needle in needles:
        assert needle in proc.stderr, f"{case}: {needle!r} not in refusal:\n{proc.stderr}"


def _dry_run_pod(
    cp: ControlPlane, namespace: str, pod: dict[str, Any]
) -> tuple[int, dict[str, Any] | None, str]:
    proc = cp.kubectl(
        "create", "--dry-run=server", "--validate=strict", "-n", namespace, "-o", "json",
        "-f", "-", input=json.dumps(pod), check=False,
    )  # fmt: skip
    return proc.returncode, json.loads(proc.stdout) if proc.returncode == 0 else None, proc.stderr


def _built_pod(cp: ControlPlane, namespace: str, manifest: dict[str, Any]) -> dict[str, Any]:
    apply(cp, namespace, manifest)
    stored = get(cp, namespace, manifest["metadata"]["name"])
    stage = parse_stage(stored)
    return build_worker_pod(stage, initial_state=DesiredState.ASLEEP, owner=owner_reference(stored))


def test_the_full_template_reaches_an_admitted_restricted_pod(
    cluster: ControlPlane, namespace: str
) -> None:
    cluster.kubectl(
        "label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted"
    )
    runtime_class = {"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass",
                     "metadata": {"name": "nvidia"}, "handler": "nvidia"}  # fmt: skip
    cluster.kubectl("apply", "-f", "-", input=json.dumps(runtime_class))
    full = good("full")
    full["spec"]["template"] = FULL_TEMPLATE
    plain = good("plain")
    loose = good("loose")
    loose["spec"]["template"] = {"securityContext": {"runAsNonRoot": False}}

    rc, pod, err = _dry_run_pod(cluster, namespace, _built_pod(cluster, namespace, full))
    assert rc == 0 and pod is not None, err
    spec = pod["spec"]
    (worker,) = spec["containers"]
    assert spec["securityContext"] == {
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
        "runAsUser": 65532,
        "fsGroup": 1000,
        "fsGroupChangePolicy": "OnRootMismatch",
    }
    assert worker["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "readOnlyRootFilesystem": True,
    }
    assert spec["imagePullSecrets"] == [{"name": "registry-credentials"}]
    assert spec["affinity"] == FULL_TEMPLATE["affinity"]
    assert spec["topologySpreadConstraints"] == FULL_TEMPLATE["topologySpreadConstraints"]
    assert spec["runtimeClassName"] == "nvidia"
    assert worker["envFrom"] == FULL_TEMPLATE["envFrom"]
    assert [c["name"] for c in spec["initContainers"]] == ["warm-cache"]
    (shm,) = [v for v in spec["volumes"] if v["name"] == "omnistage-shm"]
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    assert {"name": "omnistage-shm", "mountPath": "/dev/shm"} in worker["volumeMounts"]

    # A stage without a template is admitted too: the defaults are restricted-compatible.
    rc, _, err = _dry_run_pod(cluster, namespace, _built_pod(cluster, namespace, plain))
    assert rc == 0, err
    # The namespace really enforces: a stage that asks to run as root is refused.
    rc, _, err = _dry_run_pod(cluster, namespace, _built_pod(cluster, namespace, loose))
    assert rc != 0 and "violates PodSecurity" in err and "runAsNonRoot" in err, err
