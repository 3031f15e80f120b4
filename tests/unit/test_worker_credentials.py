"""The operator's worker credentials: shared token or a Kubernetes-issued token from a file."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import pytest

from omnistage_operator.api.spec import DesiredState
from omnistage_operator.k8s.builders import TOKEN_VOLUME, build_worker_pod
from omnistage_operator.k8s.settings import SettingsError, parse_settings
from omnistage_operator.k8s.worker_credentials import (
    WORKER_SERVICE_ACCOUNT,
    CredentialsError,
    ProjectedToken,
    SharedToken,
    token_subject,
)
from tests.unit.stage_bodies import container, make

SUB = "system:serviceaccount:omnistage-system:omnistage-operator"


def jwt(sub: str, salt: str = "") -> str:
    def part(obj: object) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj).encode()).rstrip(b"=").decode()

    return f"{part({'alg': 'ES256'})}.{part({'sub': sub, 'jti': salt})}.c2ln"


def test_token_subject() -> None:
    assert token_subject(jwt(SUB)) == SUB
    with pytest.raises(CredentialsError, match="not a JWT"):
        token_subject("opaque-shared-token")
    with pytest.raises(CredentialsError, match="not a SA"):
        token_subject(jwt("admin"))


def test_projected_token_is_reread_when_the_kubelet_rotates_it(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(jwt(SUB, "first") + "\n")
    creds = ProjectedToken(str(path))
    first = creds.current()
    assert first == jwt(SUB, "first") and creds.identity == SUB
    path.write_text(jwt(SUB, "second-and-longer"))
    os.utime(path, ns=(1, 10**18))
    assert creds.current() == jwt(SUB, "second-and-longer")
    assert creds.worker_args() == [
        "--operator-identity", SUB, "--token-audience", "omnistage-worker",
    ]  # fmt: skip
    path.unlink()  # between two rotations: the last token read stays in use
    assert creds.current() == jwt(SUB, "second-and-longer")
    with pytest.raises(CredentialsError, match="--worker-identity-token-file"):
        ProjectedToken(str(path)).current()


def test_pod_for_token_review(tmp_path: Path) -> None:
    stage, owner = make()
    built = build_worker_pod(stage, initial_state=DesiredState.ACTIVE, owner=owner)
    assert SharedToken("t").adapt(built) is built  # the shared mode keeps the Secret
    path = tmp_path / "token"
    path.write_text(jwt(SUB))
    pod = ProjectedToken(str(path)).adapt(
        build_worker_pod(stage, initial_state=DesiredState.ACTIVE, owner=owner)
    )
    args = container(pod)["args"]
    assert "--token-file" not in args
    at = args.index("--operator-identity")
    assert args[at : at + 4] == ["--operator-identity", SUB, "--token-audience", "omnistage-worker"]
    assert TOKEN_VOLUME not in {v["name"] for v in pod["spec"]["volumes"]}
    assert TOKEN_VOLUME not in {m["name"] for m in container(pod)["volumeMounts"]}
    assert pod["spec"]["serviceAccountName"] == WORKER_SERVICE_ACCOUNT
    assert pod["spec"]["automountServiceAccountToken"] is True
    own, owner = make(template={"serviceAccountName": "team-worker"})
    pod = ProjectedToken(str(path)).adapt(
        build_worker_pod(own, initial_state=DesiredState.ACTIVE, owner=owner)
    )
    assert pod["spec"]["serviceAccountName"] == "team-worker"


def test_settings_choose_the_mode(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.write_text("s3cret")
    projected = tmp_path / "projected"
    projected.write_text(jwt(SUB))
    creds = parse_settings([f"--worker-token-file={shared}"], {}).worker_credentials()
    assert isinstance(creds, SharedToken) and creds.shared == "s3cret"
    settings = parse_settings([f"--worker-identity-token-file={projected}"], {})
    creds = settings.worker_credentials()
    assert isinstance(creds, ProjectedToken) and creds.shared is None
    with pytest.raises(SettingsError, match="not both"):
        parse_settings(
            [f"--worker-token-file={shared}", f"--worker-identity-token-file={projected}"], {}
        )
    with pytest.raises(SettingsError, match="not a JWT"):
        parse_settings([f"--worker-identity-token-file={shared}"], {}).worker_credentials()
