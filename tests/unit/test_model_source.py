"""``spec.model.source`` in the worker pod: an init container fetches the model into the model
volume before the worker starts. The fetcher itself: tests/worker/test_fetch.py; the pod on
localnode with a local hub: tests/e2e/test_model_source.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from omnistage_operator.builders import build_worker_pod
from omnistage_operator.pod_hash import pod_spec_hash
from omnistage_operator.spec import DesiredState, SpecError
from omnistage_operator.spec_parse import parse_stage
from tests.unit.test_pod_template import OWNER, body

HUB = {"url": "https://hub.example", "repo": "org/model"}


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
        (_model(source={}), "spec.model.source.hub"),
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


def test_the_source_is_part_of_the_pod_hash() -> None:
    plain = pod_spec_hash(parse_stage(body()))
    assert plain == "29ea4d4a8175baf3"  # unchanged for stages without a source
    one = pod_spec_hash(parse_stage(body(model=_model(source={"hub": HUB}))))
    other = {"hub": {**HUB, "revision": "v2"}}
    assert one != plain and one != pod_spec_hash(parse_stage(body(model=_model(source=other))))
