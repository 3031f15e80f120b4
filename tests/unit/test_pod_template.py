"""``spec.template``'s adaptable pod fields: parsed, refused naming the field, merged into the pod.

The API server's verdict (CRD rules, Pod Security admission) is tests/e2e/test_pod_template.py.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from omnistage_operator.api.pod_template import (
    DEFAULT_CONTAINER_SECURITY_CONTEXT,
    DEFAULT_POD_SECURITY_CONTEXT,
    PodExtras,
    parse_pod_extras,
)
from omnistage_operator.api.spec import RESERVED_VOLUMES, DesiredState, SpecError
from omnistage_operator.api.spec_parse import parse_stage
from omnistage_operator.k8s.builders import build_worker_pod
from omnistage_operator.k8s.pod_hash import pod_spec_hash

OWNER = {"apiVersion": "omnistage.io/v1alpha1", "kind": "OmniStage", "name": "s", "uid": "u",
         "controller": True, "blockOwnerDeletion": True}  # fmt: skip


def body(template: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "metadata": {"name": "s", "namespace": "ns", "uid": "u", "generation": 1},
        "spec": {
            "runner": "AR",
            "backend": "Transformers",
            "image": "img:1",
            "model": {"path": "/models/m"},
            "colocation": {"group": "g"},
            **spec,
        },
    }
    if template is not None:
        out["spec"]["template"] = template
    return out


def pod(template: dict[str, Any] | None = None) -> dict[str, Any]:
    stage = parse_stage(body(template))
    return build_worker_pod(stage, initial_state=DesiredState.ASLEEP, owner=OWNER)


def test_default_pod_meets_the_restricted_standard() -> None:
    spec = pod()["spec"]
    (worker,) = spec["containers"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    # the worker image's group owns the Secret volumes: the non-root worker reads its token
    assert spec["securityContext"]["fsGroup"] == 65532
    assert worker["securityContext"]["allowPrivilegeEscalation"] is False
    assert worker["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    for absent in ("imagePullSecrets", "affinity", "topologySpreadConstraints",
                   "runtimeClassName", "initContainers"):  # fmt: skip
        assert absent not in spec
    assert "envFrom" not in worker
    assert all(m["mountPath"] != "/dev/shm" for m in worker["volumeMounts"])


def test_given_security_keys_win_key_by_key() -> None:
    spec = pod(
        {
            "securityContext": {"runAsUser": 1000, "runAsNonRoot": False},
            "containerSecurityContext": {"capabilities": {"add": ["SYS_PTRACE"]}},
        }
    )["spec"]
    assert spec["securityContext"] == {
        "runAsNonRoot": False,
        "runAsUser": 1000,
        "seccompProfile": {"type": "RuntimeDefault"},
        "fsGroup": 65532,
        "fsGroupChangePolicy": "OnRootMismatch",
    }
    assert spec["containers"][0]["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "capabilities": {"add": ["SYS_PTRACE"]},
    }
    # the defaults are never shared with a built pod
    assert DEFAULT_POD_SECURITY_CONTEXT["runAsNonRoot"] is True
    assert DEFAULT_CONTAINER_SECURITY_CONTEXT["capabilities"] == {"drop": ["ALL"]}


def test_every_field_reaches_the_pod() -> None:
    affinity: dict[str, Any] = {
        "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}
    }
    spread = [{"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule"}]
    env_from = [{"secretRef": {"name": "hub"}, "prefix": "HF_"}]
    init = [{"name": "fetch", "image": "busybox", "command": ["true"]}]
    template = {
        "imagePullSecrets": [{"name": "pull"}],
        "affinity": affinity,
        "topologySpreadConstraints": spread,
        "runtimeClassName": "nvidia",
        "envFrom": env_from,
        "initContainers": init,
        "shmSize": "16Gi",
        "volumes": [{"name": "cache", "emptyDir": {}}],
        "volumeMounts": [{"name": "cache", "mountPath": "/cache"}],
    }
    given = copy.deepcopy(template)
    spec = pod(template)["spec"]
    (worker,) = spec["containers"]
    assert spec["imagePullSecrets"] == [{"name": "pull"}]
    assert spec["affinity"] == affinity and spec["topologySpreadConstraints"] == spread
    assert spec["runtimeClassName"] == "nvidia"
    assert worker["envFrom"] == env_from and spec["initContainers"] == init
    assert spec["volumes"][-1] == {
        "name": "omnistage-shm",
        "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"},
    }
    assert worker["volumeMounts"][-1] == {"name": "omnistage-shm", "mountPath": "/dev/shm"}
    assert {"name": "cache", "mountPath": "/cache"} in worker["volumeMounts"]
    # the operator's own env stays explicit, so it overrides any envFrom source's keys
    assert {e["name"] for e in worker["env"]} >= {"POD_IP", "OMNISTAGE_STAGE"}
    spec["initContainers"][0]["name"] = "changed"
    assert template == given, "the built pod shares objects with the spec"


@pytest.mark.parametrize(
    ("template", "field"),
    [
        ({"initContainers": [{"name": "worker", "image": "x"}]},
         "spec.template.initContainers[0].name"),
        ({"initContainers": [{"name": "omnistage-model", "image": "x"}]},
         "spec.template.initContainers[0].name"),
        ({"imagePullSecrets": [{}]}, "spec.template.imagePullSecrets[0].name"),
        ({"imagePullSecrets": "pull"}, "spec.template.imagePullSecrets"),
        ({"affinity": []}, "spec.template.affinity"),
        ({"envFrom": [1]}, "spec.template.envFrom[0]"),
        ({"shmSize": "lots"}, "spec.template.shmSize"),
        ({"shmSize": 0}, "spec.template.shmSize"),
        ({"runtimeClassName": 3}, "spec.template.runtimeClassName"),
        (
            {"shmSize": "1Gi", "volumeMounts": [{"name": "v", "mountPath": "/dev/shm/"}]},
            "spec.template.volumeMounts[0].mountPath",
        ),
    ],
)  # fmt: skip
def test_unreadable_fields_are_refused_naming_them(template: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_stage(body(template))
    assert info.value.field == field


def test_shm_volume_name_is_reserved() -> None:
    assert "omnistage-shm" in RESERVED_VOLUMES


def test_pods_of_specs_without_the_new_fields_keep_their_hash() -> None:
    """An operator upgrade must not replace running pods: the hash of a spec that sets none of
    these fields is the one the previous operator computed (values from before this module)."""
    assert pod_spec_hash(parse_stage(body())) == "29ea4d4a8175baf3"
    older = body(
        {"env": [{"name": "A", "value": "1"}], "nodeSelector": {"a": "b"}},
        runner="Diffusion",
        backend="Diffusers",
    )
    assert pod_spec_hash(parse_stage(older)) == "5318b3e996c17785"


@pytest.mark.parametrize(
    "template",
    [
        {"securityContext": {"runAsUser": 1}},
        {"containerSecurityContext": {"readOnlyRootFilesystem": True}},
        {"imagePullSecrets": [{"name": "p"}]},
        {"affinity": {"nodeAffinity": {}}},
        {"runtimeClassName": "nvidia"},
        {"envFrom": [{"configMapRef": {"name": "c"}}]},
        {"initContainers": [{"name": "i", "image": "x"}]},
        {"shmSize": "1Gi"},
    ],
)
def test_each_field_changes_the_pod_hash(template: dict[str, Any]) -> None:
    """A pod cannot follow these fields: a change means a new pod."""
    assert pod_spec_hash(parse_stage(body(template))) != pod_spec_hash(parse_stage(body()))


def test_parse_reads_nothing_from_an_empty_template() -> None:
    assert parse_pod_extras({}) == PodExtras()
