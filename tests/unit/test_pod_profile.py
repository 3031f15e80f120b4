"""The operator's own settings that shape every worker pod (log format, worker credentials):
passed to the worker and part of the pod's spec hash, so changing them replaces the pods."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

from omnistage_operator.api.spec import DesiredState
from omnistage_operator.k8s.builders import build_worker_pod
from omnistage_operator.k8s.pod_hash import DEFAULT_PROFILE, PodProfile, pod_spec_hash
from omnistage_operator.k8s.worker_credentials import ProjectedToken, SharedToken
from tests.unit.stage_bodies import container, make


def env_of(pod: dict[str, Any]) -> list[tuple[str, Any]]:
    return [(e["name"], e.get("value")) for e in container(pod)["env"]]


def hash_of(pod: dict[str, Any]) -> str:
    return str(pod["metadata"]["annotations"]["omnistage.io/pod-spec-hash"])


def build(profile: PodProfile = DEFAULT_PROFILE, **spec: Any) -> dict[str, Any]:
    stage, owner = make(**spec)
    return build_worker_pod(stage, initial_state=DesiredState.ACTIVE, owner=owner, profile=profile)


def test_default_profile_changes_nothing() -> None:
    stage, _ = make()
    pod = build()
    assert hash_of(pod) == pod_spec_hash(stage)  # pods made before the profile keep theirs
    assert "OMNISTAGE_LOG_FORMAT" not in dict(env_of(pod))


def test_json_logs_reach_the_worker_and_replace_its_pod() -> None:
    profile = PodProfile(log_format="json")
    pod = build(profile)
    assert ("OMNISTAGE_LOG_FORMAT", "json") in env_of(pod)
    assert hash_of(pod) != hash_of(build())
    assert hash_of(pod) == pod_spec_hash(make()[0], profile)


def test_the_stage_env_wins_over_the_operator_format() -> None:
    own = {"name": "OMNISTAGE_LOG_FORMAT", "value": "text"}
    pod = build(PodProfile(log_format="json"), template={"env": [own]})
    assert [v for n, v in env_of(pod) if n == "OMNISTAGE_LOG_FORMAT"] == ["text"]


def _token_file(tmp_path: Path, subject: str) -> Path:
    claims = base64.urlsafe_b64encode(json.dumps({"sub": subject}).encode()).rstrip(b"=")
    path = tmp_path / "token"
    path.write_text(f"e30.{claims.decode()}.sig")
    return path


def test_credential_mode_is_part_of_the_pod(tmp_path: Path) -> None:
    shared = PodProfile(credential_args=SharedToken("t").pod_flags())
    sa = "system:serviceaccount:omnistage-system:omnistage-operator"
    projected = ProjectedToken(str(_token_file(tmp_path, sa)))
    review = PodProfile(credential_args=projected.pod_flags())
    assert shared == DEFAULT_PROFILE
    assert review.credential_args == (
        "--operator-identity",
        sa,
        "--token-audience",
        projected.audience,
    )
    stage, _ = make()
    assert pod_spec_hash(stage, review) != pod_spec_hash(stage, shared)
    other = PodProfile(credential_args=("--operator-identity", sa, "--token-audience", "other"))
    assert pod_spec_hash(stage, other) != pod_spec_hash(stage, review)


def test_a_handoff_host_path_gives_each_group_its_own_shared_directory() -> None:
    profile = PodProfile(handoff_host_path="/var/lib/omnistage/handoff")
    pod = build(profile)
    stage, _ = make()
    assert ("OMNISTAGE_HANDOFF_DIR", "/run/omnistage/handoff") in env_of(pod)
    [volume] = [v for v in pod["spec"]["volumes"] if v["name"] == "handoff"]
    assert volume["hostPath"] == {
        "path": f"/var/lib/omnistage/handoff/{stage.namespace}/{stage.group}",
        "type": "DirectoryOrCreate",
    }
    [mount] = [m for m in container(pod)["volumeMounts"] if m["name"] == "handoff"]
    assert mount["mountPath"] == "/run/omnistage/handoff" and not mount.get("readOnly")
    assert hash_of(pod) != hash_of(build())  # turning it on replaces the pods
    plain = build()
    assert "OMNISTAGE_HANDOFF_DIR" not in dict(env_of(plain))
    assert all(v["name"] != "handoff" for v in plain["spec"]["volumes"])
