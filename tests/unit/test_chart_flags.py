"""The operator's command line as the chart renders it (its own parser accepts it), the worker
token it mounts, and kopf peering."""

from __future__ import annotations

import base64
import re

import pytest

from tests.unit.test_chart_support import (
    CHART_DIR,
    FULLNAME,
    NAMESPACE,
    PEERING_APIS,
    one,
    operator_args,
    operator_container,
    pod_spec,
    render,
    render_error,
    select,
)


def test_default_args_follow_the_operator_contract() -> None:
    args = operator_args(render())
    assert args == [
        "--worker-token-file=/var/run/secrets/omnistage/token",
        "--metrics-port=8080",
        "--liveness-port=8081",
        "--placement=dra",
        "--device-class=gpu.nvidia.com",
        "--sleep-timeout=60",
        "--wake-timeout=600",
        "--ack-retries=3",
        "--round-wait=5",
        "--overlapped-handover",
        "--leader-election",
        f"--lease-name={FULLNAME}",
        "--lease-duration=15",
        "--renew-deadline=10",
        "--retry-period=2",
    ]
    assert not any(a.startswith("--namespace") for a in args), "default serves every namespace"
    assert not any(a.startswith("--peering") for a in args), "default is standalone"


def test_operator_values_become_flags() -> None:
    values = {
        "operator": {
            "placement": "explicit",
            "deviceClass": "gpu.example.com",
            "sleepTimeoutSeconds": 5,
            "wakeTimeoutSeconds": 30,
            "ackRetries": 2,
            "roundWaitSeconds": 1.5,
            "extraArgs": ["--verbose"],
            "extraEnv": [{"name": "TZ", "value": "UTC"}],
        },
        "workerTLS": {"caSecret": "worker-ca", "caKey": "ca.pem"},
    }
    objs = render(values)
    args = operator_args(objs)
    for flag in (
        "--placement=explicit",
        "--device-class=gpu.example.com",
        "--sleep-timeout=5",
        "--wake-timeout=30",
        "--ack-retries=2",
        "--round-wait=1.5",
        "--verbose",
        "--worker-tls-ca=/var/run/secrets/omnistage-tls/ca.crt",
    ):
        assert flag in args
    assert {"name": "TZ", "value": "UTC"} in operator_container(objs)["env"]
    ca = next(v for v in pod_spec(objs)["volumes"] if v["name"] == "worker-tls-ca")
    assert ca["secret"]["secretName"] == "worker-ca"
    assert ca["secret"]["items"] == [{"key": "ca.pem", "path": "ca.crt"}]


def test_namespaced_watch_becomes_namespace_flags() -> None:
    values = {"rbac": {"scope": "Namespaced"}, "watch": {"namespaces": ["team-a", "team-b"]}}
    args = operator_args(render(values))
    assert [a for a in args if a.startswith("--namespace")] == [
        "--namespace=team-a",
        "--namespace=team-b",
    ]


def test_namespaced_scope_without_list_serves_the_release_namespace() -> None:
    args = operator_args(render({"rbac": {"scope": "Namespaced"}}))
    assert [a for a in args if a.startswith("--namespace")] == [f"--namespace={NAMESPACE}"]


def test_rendered_args_are_accepted_by_the_operator() -> None:
    """The chart's flags parse with the operator's own parser into the values given."""
    from omnistage_operator.k8s.settings import SettingsError, parse_settings

    values = {
        "rbac": {"scope": "Namespaced"},
        "watch": {"namespaces": ["team-a", "team-b"]},
        "ports": {"metrics": 9090, "liveness": 9091},
        "operator": {
            "placement": "explicit",
            "sleepTimeoutSeconds": 7,
            "ackRetries": 4,
            "roundWaitSeconds": 2,
            "overlappedHandover": False,
            "handoffHostPath": "/var/lib/omnistage/handoff/",
        },
        "workerTLS": {"caSecret": "worker-ca"},
    }
    objs = render({**values, "peering": {"enabled": True, "name": "p"}}, api_versions=PEERING_APIS)
    settings = parse_settings(operator_args(objs), environ={})
    assert settings.namespaces == ("team-a", "team-b")
    assert settings.worker_token_file == "/var/run/secrets/omnistage/token"
    assert settings.worker_tls_ca == "/var/run/secrets/omnistage-tls/ca.crt"
    assert (settings.metrics_port, settings.liveness_port) == (9090, 9091)
    assert settings.peering == "p"
    assert settings.placement == "explicit"
    assert settings.device_class == "gpu.nvidia.com"
    assert (settings.sleep_timeout_s, settings.wake_timeout_s) == (7.0, 600.0)
    assert settings.ack_retries == 4
    assert settings.round_wait_s == 2.0
    assert not settings.overlapped_handover
    assert "--no-overlapped-handover" in operator_args(objs)
    assert settings.handoff_host_path == "/var/lib/omnistage/handoff"
    standalone = parse_settings(operator_args(render()), environ={})
    assert standalone.peering is None, "standalone by default"
    assert standalone.overlapped_handover, "overlapped hand-overs by default"
    assert standalone.handoff_host_path == "", "no hand-off directory by default"
    root = parse_settings(["--handoff-host-path=//"], environ={})
    assert root.handoff_host_path == "/", "the root, not turned off"
    with pytest.raises(SettingsError, match="--handoff-host-path: must be an absolute path"):
        parse_settings(["--handoff-host-path=handoff"], environ={})
    assert parse_settings([], environ={}).overlapped_handover, "the operator's own default"
    serial = parse_settings([], environ={"OMNISTAGE_OVERLAPPED_HANDOVER": "false"})
    assert not serial.overlapped_handover


def test_generated_token_secret_is_kept_and_random() -> None:
    first = one(render(), "Secret")
    second = one(render(), "Secret")
    assert first["metadata"]["name"] == f"{FULLNAME}-worker-token"
    assert first["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    token = base64.b64decode(first["data"]["token"]).decode()
    assert re.fullmatch(r"[A-Za-z0-9]{48}", token)
    # Without a cluster to look up, each render generates afresh: the value is random.
    assert first["data"]["token"] != second["data"]["token"]


def test_token_is_mounted_at_the_contract_path() -> None:
    objs = render()
    mount = next(m for m in operator_container(objs)["volumeMounts"] if m["name"] == "worker-token")
    assert mount == {
        "name": "worker-token",
        "mountPath": "/var/run/secrets/omnistage",
        "readOnly": True,
    }
    volume = next(v for v in pod_spec(objs)["volumes"] if v["name"] == "worker-token")
    assert volume["secret"]["secretName"] == f"{FULLNAME}-worker-token"
    assert volume["secret"]["items"] == [{"key": "token", "path": "token"}]


def test_existing_token_secret_is_used_and_not_generated() -> None:
    objs = render({"workerToken": {"existingSecret": "my-token", "key": "bearer"}})
    assert select(objs, "Secret") == []
    volume = next(v for v in pod_spec(objs)["volumes"] if v["name"] == "worker-token")
    assert volume["secret"]["secretName"] == "my-token"
    assert volume["secret"]["items"] == [{"key": "bearer", "path": "token"}]


def test_peering_on_cluster_wide() -> None:
    objs = render({"peering": {"enabled": True}}, api_versions=PEERING_APIS)
    peering = one(objs, "ClusterKopfPeering")
    assert peering["apiVersion"] == "kopf.dev/v1"
    assert peering["metadata"]["name"] == FULLNAME
    assert f"--peering={FULLNAME}" in operator_args(objs)
    assert select(objs, "KopfPeering") == []


def test_peering_on_namespaced_creates_one_per_namespace() -> None:
    values = {
        "peering": {"enabled": True, "name": "shared"},
        "rbac": {"scope": "Namespaced"},
        "watch": {"namespaces": ["team-a", "team-b"]},
    }
    objs = render(values, api_versions=PEERING_APIS)
    peerings = select(objs, "KopfPeering")
    assert sorted(p["metadata"]["namespace"] for p in peerings) == ["team-a", "team-b"]
    assert {p["metadata"]["name"] for p in peerings} == {"shared"}
    assert "--peering=shared" in operator_args(objs)


def test_peering_without_kopf_crds_is_refused_with_the_fix() -> None:
    err = render_error({"peering": {"enabled": True}})
    assert "files/kopf-peering-crds.yaml" in err


def test_peering_crds_file_defines_both_kinds() -> None:
    import yaml

    docs = list(yaml.safe_load_all((CHART_DIR / "files" / "kopf-peering-crds.yaml").read_text()))
    kinds = {(d["spec"]["names"]["kind"], d["spec"]["scope"]) for d in docs}
    assert kinds == {("ClusterKopfPeering", "Cluster"), ("KopfPeering", "Namespaced")}
