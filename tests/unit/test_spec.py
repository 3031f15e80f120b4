"""parse_stage: typed specs with defaults, and errors that name the field."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from omnistage_operator.api.spec import (
    Backend,
    DesiredState,
    PlacementMode,
    Runner,
    SpecError,
    StageSpec,
    WorkerDevice,
)
from omnistage_operator.api.spec_parse import parse_stage


def body(**spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "apiVersion": "omnistage.io/v1alpha1",
        "kind": "OmniStage",
        "metadata": {"name": "llm", "namespace": "ml", "uid": "u-1", "generation": 3},
        "spec": {
            "runner": "AR",
            "backend": "Transformers",
            "model": {"path": "/models/tiny-llama"},
            "image": "omnistage-worker:dev",
            "colocation": {"group": "g1"},
        },
    }
    base["spec"].update(spec)
    return base


def test_minimal_body_gets_crd_defaults() -> None:
    stage = parse_stage(body())
    assert isinstance(stage, StageSpec)
    assert (stage.name, stage.namespace, stage.uid, stage.generation) == ("llm", "ml", "u-1", 3)
    assert stage.runner is Runner.AR and stage.backend is Backend.TRANSFORMERS
    assert stage.state is DesiredState.ACTIVE and stage.wants_active
    assert stage.sleep_level == 1
    assert stage.gpus == 1
    assert stage.priority == 0 and stage.group == "g1"
    assert stage.model.mount_path == "/models" and stage.model.volume is None
    assert stage.vram_request is None and stage.vram_request_bytes is None
    assert stage.placement.mode is PlacementMode.DRA
    assert stage.worker.port == 50051 and stage.worker.device is None
    assert stage.drain_timeout_s == 600
    assert stage.key == "ml/llm"
    hash(stage)  # usable as a dict key / set member


def test_full_body() -> None:
    stage = parse_stage(
        body(
            runner="Diffusion",
            backend="Diffusers",
            state="Asleep",
            sleepLevel=2,
            gpus=2,
            vram={"request": "16Gi"},
            colocation={"group": "g1", "priority": 10},
            model={"path": "/m/sd", "mountPath": "/m", "volume": {"hostPath": {"path": "/data"}}},
            placement={"mode": "Explicit", "nodeName": "n1", "devices": ["0", "1"]},
            worker={"port": 6000, "device": "cpu", "args": ["--steps", "2"], "dtype": "float32"},
            template={
                "env": [{"name": "HF_HOME", "value": "/tmp"}],
                "nodeSelector": {"gpu": "h100"},
                "labels": {"team": "a"},
                "serviceAccountName": "sa",
            },
        )
    )
    assert stage.runner is Runner.DIFFUSION and stage.runner.cli == "diffusion"
    assert stage.backend.cli == "diffusers" and stage.state.cli == "asleep"
    assert stage.vram_request == "16Gi" and stage.vram_request_bytes == 16 * 1024**3
    assert stage.placement.devices == ("0", "1") and stage.placement.node_name == "n1"
    assert stage.worker.device is WorkerDevice.CPU and stage.worker.args == ("--steps", "2")
    assert stage.template.env == ({"name": "HF_HOME", "value": "/tmp"},)
    assert stage.template.service_account_name == "sa"
    assert stage.model.volume == {"hostPath": {"path": "/data"}}


def test_parsed_copies_do_not_alias_the_body() -> None:
    b = body(template={"env": [{"name": "A", "value": "1"}]})
    stage = parse_stage(b)
    b["spec"]["template"]["env"][0]["value"] = "changed"
    assert stage.template.env[0]["value"] == "1"


def _set(b: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    b = copy.deepcopy(b)
    node = b
    parts = dotted.split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    if value is _DELETE:
        node.pop(parts[-1], None)
    else:
        node[parts[-1]] = value
    return b


_DELETE = object()


@pytest.mark.parametrize(
    ("dotted", "value", "field", "needle"),
    [
        ("spec.runner", "GAN", "spec.runner", "one of Diffusion, AR"),
        ("spec.runner", _DELETE, "spec.runner", "required"),
        ("spec.image", _DELETE, "spec.image", "required"),
        ("spec.model", _DELETE, "spec.model", "required"),
        (
            "spec.model.volume",
            {"name": "x", "hostPath": {"path": "/"}},
            "spec.model.volume",
            "name",
        ),
        ("spec.state", "Sleeping", "spec.state", "Active, Asleep"),
        ("spec.sleepLevel", "1", "spec.sleepLevel", "integer"),
        ("spec.colocation.group", _DELETE, "spec.colocation.group", "required"),
        ("spec.vram.request", "16GB", "spec.vram.request", "not a quantity"),
        ("spec.placement.mode", "Static", "spec.placement.mode", "DRA, Explicit"),
        ("spec.worker.device", "tpu", "spec.worker.device", "auto, cpu, cuda"),
        ("spec.worker.args", "--x", "spec.worker.args", "list"),
        ("spec.template.nodeSelector", {"a": 1}, "spec.template.nodeSelector.a", "strings"),
        (
            "spec.template.volumeMounts",
            [{"name": "t", "mountPath": "/var/run/secrets/omnistage/"}],
            "spec.template.volumeMounts[0].mountPath",
            "used by the operator",
        ),
    ],
)
def test_bad_bodies_name_the_field(dotted: str, value: Any, field: str, needle: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_stage(_set(body(), dotted, value))
    assert info.value.field == field
    assert needle in info.value.message
    assert str(info.value).startswith(f"{field}: ")


def test_vllm_is_an_ar_backend() -> None:
    assert parse_stage(body(backend="VLLM")).backend is Backend.VLLM


def test_missing_spec() -> None:
    with pytest.raises(SpecError) as info:
        parse_stage({"metadata": {"name": "x"}})
    assert info.value.field == "spec"
