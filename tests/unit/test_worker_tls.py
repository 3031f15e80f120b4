"""``spec.worker.tls`` in the worker pod: TLS flags and Secret, probes on the plaintext health
port. The running pair (operator over TLS, kubelet-style probes) is tests/e2e/test_worker_tls.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from omnistage_operator.api.spec import RESERVED_ARGS, RESERVED_VOLUMES, DesiredState, SpecError
from omnistage_operator.api.spec_parse import parse_stage
from omnistage_operator.k8s.builders import build_worker_pod
from omnistage_operator.k8s.pod_hash import pod_spec_hash
from omnistage_operator.k8s.worker_command import worker_args
from tests.unit.test_pod_template import OWNER, body


def _pod(worker: dict[str, Any]) -> dict[str, Any]:
    stage = parse_stage(body(worker=worker))
    return build_worker_pod(stage, initial_state=DesiredState.ASLEEP, owner=OWNER)


def test_without_tls_the_grpc_port_is_probed_and_nothing_is_added() -> None:
    pod = _pod({})
    (worker,) = pod["spec"]["containers"]
    assert worker["readinessProbe"]["grpc"]["port"] == 50051
    assert worker["livenessProbe"]["grpc"]["port"] == 50051
    assert "health" not in [p["name"] for p in worker["ports"]]
    assert not {"--tls-cert", "--tls-key", "--health-port"} & set(worker["args"])
    assert all(v["name"] != "omnistage-tls" for v in pod["spec"]["volumes"])


def test_tls_mounts_the_secret_and_probes_the_plaintext_health_port() -> None:
    pod = _pod({"tls": {"secretName": "stage-cert"}, "port": 6000})
    (worker,) = pod["spec"]["containers"]
    args = worker["args"]
    assert args[args.index("--tls-cert") + 1] == "/var/run/secrets/omnistage-tls/tls.crt"
    assert args[args.index("--tls-key") + 1] == "/var/run/secrets/omnistage-tls/tls.key"
    assert args[args.index("--health-port") + 1] == "50052"
    assert args[args.index("--port") + 1] == "6000"
    for probe in ("readinessProbe", "livenessProbe"):
        assert worker[probe]["grpc"]["port"] == 50052
    assert {"name": "health", "containerPort": 50052, "protocol": "TCP"} in worker["ports"]
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "omnistage-tls"]
    assert volume["secret"]["secretName"] == "stage-cert"
    assert {i["key"] for i in volume["secret"]["items"]} == {"tls.crt", "tls.key"}
    mount = {"name": "omnistage-tls", "mountPath": "/var/run/secrets/omnistage-tls",
             "readOnly": True}  # fmt: skip
    assert mount in worker["volumeMounts"]


def test_health_port_is_configurable() -> None:
    stage = parse_stage(body(worker={"tls": {"secretName": "c"}, "healthPort": 9090}))
    args = worker_args(stage, initial_state=DesiredState.ACTIVE)
    assert args[args.index("--health-port") + 1] == "9090"


def test_tls_changes_the_pod_hash_and_plain_specs_keep_theirs() -> None:
    plain = pod_spec_hash(parse_stage(body()))
    assert plain == "29ea4d4a8175baf3"  # as before spec.worker.tls existed
    assert pod_spec_hash(parse_stage(body(worker={"healthPort": 9090}))) == plain
    tls = pod_spec_hash(parse_stage(body(worker={"tls": {"secretName": "c"}})))
    assert tls != plain
    other = pod_spec_hash(parse_stage(body(worker={"tls": {"secretName": "d"}})))
    assert other != tls


@pytest.mark.parametrize(
    ("worker", "field"),
    [
        ({"tls": {"secretName": "Not_A_Name"}}, "spec.worker.tls.secretName"),
        ({"tls": {}}, "spec.worker.tls.secretName"),
        ({"tls": "cert"}, "spec.worker.tls"),
        ({"healthPort": 80}, "spec.worker.healthPort"),
    ],
)
def test_bad_tls_fields_are_refused_naming_them(worker: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_stage(body(worker=worker))
    assert info.value.field == field


def test_the_tls_flags_and_volume_are_the_operators() -> None:
    assert {"--tls-cert", "--tls-key", "--health-port"} <= RESERVED_ARGS
    assert "omnistage-tls" in RESERVED_VOLUMES
