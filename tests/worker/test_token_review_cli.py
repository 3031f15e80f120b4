"""The worker's TokenReview flags: refusals name the flag; outside a pod the API server comes
from $KUBECONFIG."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
import yaml

from omnistage_worker.cli import build_parser, config_from_args
from omnistage_worker.config import ConfigError, WorkerConfig

OPERATOR = "system:serviceaccount:omnistage-system:omnistage-operator"
BASE = ["--runner", "ar", "--backend", "transformers", "--model", "."]


def _config(argv: list[str]) -> WorkerConfig:
    return config_from_args(build_parser({}).parse_args([*BASE, *argv]))


def test_refusals_name_the_flag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT", "KUBECONFIG"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ConfigError) as info:
        _config(["--operator-identity", "operator", "--kube-server", "https://k:6443"])
    assert info.value.flag == "--operator-identity"
    with pytest.raises(ConfigError) as info:
        _config(["--operator-identity", OPERATOR])
    assert info.value.flag == "--kube-server"
    token = tmp_path / "token"
    token.write_text("shared")
    with pytest.raises(ConfigError) as info:
        _config(["--operator-identity", OPERATOR, "--kube-server", "https://k", "--token-file",
                 str(token)])  # fmt: skip
    assert info.value.flag == "--token-file"


def test_api_server_from_kubeconfig(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"):
        monkeypatch.delenv(var, raising=False)
    kubeconfig = tmp_path / "kubeconfig"
    ca = b"-----BEGIN CERTIFICATE-----\n"
    cluster = {"server": "https://10.0.0.1:6443", "certificate-authority-data": base64.b64encode(ca)
               .decode()}  # fmt: skip
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "clusters": [{"name": "c", "cluster": cluster}],
                "users": [{"name": "u", "user": {"token": "worker-sa-token"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    review = _config(["--operator-identity", OPERATOR]).token_review
    assert review is not None
    assert review.server == "https://10.0.0.1:6443" and review.operator_identity == OPERATOR
    assert review.token_file.read_text() == "worker-sa-token"
    assert review.ca_file is not None and review.ca_file.read_bytes() == ca
    kubeconfig.write_text(yaml.safe_dump({"current-context": "x"}))
    with pytest.raises(ConfigError, match="no context named 'x'"):
        _config(["--operator-identity", OPERATOR])
