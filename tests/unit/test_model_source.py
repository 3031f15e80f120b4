"""``spec.model.source`` in the worker pod: an init container fetches the model into the model
volume before the worker starts. The fetcher itself: tests/worker/test_fetch.py; the pod on
localnode with a local hub: tests/e2e/test_model_source.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from omnistage_operator.api.spec import DesiredState, SpecError
from omnistage_operator.api.spec_parse import parse_stage
from omnistage_operator.k8s.builders import build_worker_pod
from omnistage_operator.k8s.pod_hash import pod_spec_hash
from tests.unit.test_pod_template import OWNER, body

HUB = {"url": "https://hub.example", "repo": "org/model"}
S3 = {"endpoint": "http://minio.storage:9000", "bucket": "models"}


def _model(**model: Any) -> dict[str, Any]:
    return {"path": "/models/org/model", "mountPath": "/models", **model}


def _pod(model: dict[str, Any], template: dict[str, Any] | None = None) -> dict[str, Any]:
    stage = parse_stage(body(template, model=model))
    return build_worker_pod(stage, initial_state=DesiredState.ASLEEP, owner=OWNER)


def test_the_init_container_fetches_into_the_volume_before_the_worker() -> None:
    pvc = {"persistentVolumeClaim": {"claimName": "models"}}
    hub = {**HUB, "revision": "v1.0", "tokenSecret": {"name": "hub-token"}}
    pod = _pod(_model(volume=pvc, source={"hub": hub}),
               {"initContainers": [{"name": "mine", "image": "x"}]})  # fmt: skip
    spec = pod["spec"]
    fetch, mine = spec["initContainers"]
    assert (fetch["name"], mine["name"]) == ("omnistage-model", "mine")
    assert fetch["image"] == "img:1"
    assert fetch["command"] == ["python3", "-m", "omnistage_worker.fetch"]
    args = fetch["args"]
    assert args[args.index("--hub") + 1] == "https://hub.example"
    assert args[args.index("--repo") + 1] == "org/model"
    assert args[args.index("--revision") + 1] == "v1.0"
    assert args[args.index("--dest") + 1] == "/models/org/model"
    assert fetch["volumeMounts"] == [{"name": "model", "mountPath": "/models"}]  # read-write
    assert fetch["env"] == [
        {"name": "HF_TOKEN",
         "valueFrom": {"secretKeyRef": {"name": "hub-token", "key": "token"}}}
    ]  # fmt: skip
    (worker,) = spec["containers"]
    assert fetch["securityContext"] == worker["securityContext"]
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in worker["volumeMounts"]
    (volume,) = [v for v in spec["volumes"] if v["name"] == "model"]
    assert volume == {"name": "model", **pvc}


def test_without_a_volume_the_model_goes_to_an_empty_dir() -> None:
    spec = _pod(_model(source={"hub": HUB}))["spec"]
    (volume,) = [v for v in spec["volumes"] if v["name"] == "model"]
    assert volume == {"name": "model", "emptyDir": {}}
    assert "env" not in spec["initContainers"][0]


@pytest.mark.parametrize(
    ("model", "field"),
    [
        (_model(source={"hub": {**HUB, "repo": "no-slash"}}), "spec.model.source.hub.repo"),
        (_model(source={"hub": {**HUB, "url": "ftp://x"}}), "spec.model.source.hub.url"),
        (_model(source={}), "spec.model.source"),
        (_model(source={"hub": HUB, "s3": S3}), "spec.model.source"),
        (_model(source={"s3": {**S3, "bucket": "Has_Capitals"}}), "spec.model.source.s3.bucket"),
        (_model(source={"s3": {**S3, "endpoint": "s3.example"}}),
         "spec.model.source.s3.endpoint"),
        (_model(source={"s3": {**S3, "region": "US East"}}), "spec.model.source.s3.region"),
        (_model(source={"s3": {**S3, "pathStyle": "yes"}}), "spec.model.source.s3.pathStyle"),
        (_model(source={"s3": {**S3, "credentialsSecret": {"accessKeyIdKey": "id"}}}),
         "spec.model.source.s3.credentialsSecret"),
        (
            _model(source={"hub": HUB},
                   volume={"persistentVolumeClaim": {"claimName": "m", "readOnly": True}}),
            "spec.model.volume.persistentVolumeClaim.readOnly",
        ),
    ],
)  # fmt: skip
def test_bad_source_is_refused_naming_the_field(model: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_stage(body(model=model))
    assert info.value.field == field


def test_an_s3_source_fetches_with_the_credentials_secret() -> None:
    s3 = {**S3, "prefix": "org/model", "region": "eu-west-1", "pathStyle": True,
          "credentialsSecret": {"name": "store", "secretAccessKeyKey": "secret"}}  # fmt: skip
    pvc = {"persistentVolumeClaim": {"claimName": "models"}}
    spec = _pod(_model(volume=pvc, source={"s3": s3}))["spec"]
    (fetch,) = spec["initContainers"]
    assert fetch["command"] == ["python3", "-m", "omnistage_worker.fetch_s3"]
    assert fetch["args"] == [
        "--endpoint", "http://minio.storage:9000", "--bucket", "models", "--prefix", "org/model",
        "--region", "eu-west-1", "--path-style", "--dest", "/models/org/model",
    ]  # fmt: skip
    assert fetch["env"] == [
        {"name": "AWS_ACCESS_KEY_ID",
         "valueFrom": {"secretKeyRef": {"name": "store", "key": "AWS_ACCESS_KEY_ID"}}},
        {"name": "AWS_SECRET_ACCESS_KEY",
         "valueFrom": {"secretKeyRef": {"name": "store", "key": "secret"}}},
    ]  # fmt: skip
    assert fetch["volumeMounts"] == [{"name": "model", "mountPath": "/models"}]
    plain = _pod(_model(source={"s3": S3}))["spec"]["initContainers"][0]
    assert "env" not in plain and "--path-style" not in plain["args"]  # anonymous, virtual-hosted
    assert plain["args"][plain["args"].index("--region") + 1] == "us-east-1"


def test_the_source_is_part_of_the_pod_hash() -> None:
    plain = pod_spec_hash(parse_stage(body()))
    assert plain == "29ea4d4a8175baf3"  # unchanged for stages without a source
    one = pod_spec_hash(parse_stage(body(model=_model(source={"hub": HUB}))))
    assert one == "1364bee53996dde3"  # unchanged for stages with a hub source, as before S3
    other = {"hub": {**HUB, "revision": "v2"}}
    assert one != plain and one != pod_spec_hash(parse_stage(body(model=_model(source=other))))
    s3 = pod_spec_hash(parse_stage(body(model=_model(source={"s3": S3}))))
    moved = {"s3": {**S3, "prefix": "other"}}
    assert s3 not in (plain, one, pod_spec_hash(parse_stage(body(model=_model(source=moved)))))
