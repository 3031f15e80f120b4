"""The real API server enforces ``spec.model.source``: exactly one of hub and s3, each
refused naming its field when bad; an S3 source gets its defaults and parses back."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from omnistage_operator.api.model_source import S3Source
from omnistage_operator.api.spec_parse import parse_stage
from tests.cluster.controlplane import ControlPlane
from tests.e2e.crd_stage import apply, cluster, get, good

__all__ = ["cluster"]  # the fixture: the control plane with the CRD established
pytestmark = pytest.mark.cluster

HUB = {"url": "https://hub.example", "repo": "org/model"}
S3 = {"endpoint": "http://minio.storage:9000", "bucket": "models", "prefix": "org/model"}


def _with_source(name: str, source: dict[str, Any]) -> dict[str, Any]:
    manifest = good(name)
    manifest["spec"]["model"] = {"path": "/models/org/model", "source": copy.deepcopy(source)}
    return manifest


@pytest.mark.parametrize(
    ("case", "source", "needles"),
    [
        ("neither", {}, ("spec.model.source", "exactly one of hub and s3")),
        ("both", {"hub": HUB, "s3": S3}, ("spec.model.source", "exactly one of hub and s3")),
        ("no-bucket", {"s3": {"endpoint": S3["endpoint"]}},
         ("spec.model.source.s3.bucket", "Required value")),
        ("bad-bucket", {"s3": {**S3, "bucket": "Models_1"}},
         ("spec.model.source.s3.bucket", "should match")),
        ("bad-endpoint", {"s3": {**S3, "endpoint": "minio:9000"}},
         ("spec.model.source.s3.endpoint", "should match")),
        ("secret-without-name", {"s3": {**S3, "credentialsSecret": {"accessKeyIdKey": "id"}}},
         ("spec.model.source.s3.credentialsSecret.name", "Required value")),
    ],
)  # fmt: skip
def test_bad_source_is_refused_naming_the_field(
    cluster: ControlPlane,
    namespace: str,
    case: str,
    source: dict[str, Any],
    needles: tuple[str, ...],
) -> None:
    proc = apply(cluster, namespace, _with_source(f"src-{case}", source), check=False)
    assert proc.returncode != 0, f"{case}: accepted:\n{proc.stdout}"
    for needle in needles:
        assert needle in proc.stderr, f"{case}: {needle!r} not in refusal:\n{proc.stderr}"


def test_an_s3_source_gets_its_defaults_and_parses_back(
    cluster: ControlPlane, namespace: str
) -> None:
    source = {"s3": {**S3, "credentialsSecret": {"name": "store"}}}
    apply(cluster, namespace, _with_source("src-s3", source))
    stored = get(cluster, namespace, "src-s3")
    s3 = stored["spec"]["model"]["source"]["s3"]
    assert (s3["region"], s3["pathStyle"]) == ("us-east-1", False)
    assert s3["credentialsSecret"] == {
        "name": "store",
        "accessKeyIdKey": "AWS_ACCESS_KEY_ID",
        "secretAccessKeyKey": "AWS_SECRET_ACCESS_KEY",
    }
    assert parse_stage(stored).model.source == S3Source(
        endpoint=S3["endpoint"], bucket="models", prefix="org/model", credentials_secret="store"
    )
