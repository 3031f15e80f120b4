"""Property tests: for any valid OmniStage, the built pod keeps the contract's invariants."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from omnistage_operator.api.labels import RESERVED_LABELS
from omnistage_operator.api.spec import Backend, DesiredState, PlacementMode
from omnistage_operator.api.spec_parse import parse_stage
from omnistage_operator.k8s.builders import (
    build_service,
    build_worker_pod,
    claim_name,
    owner_reference,
)
from omnistage_operator.k8s.worker_command import worker_device

TOKEN = "tok-9f8e7d6c5b4a"
dns = st.from_regex(r"[a-z][a-z0-9]{0,10}(-[a-z0-9]{1,5})?", fullmatch=True)
env_names = st.from_regex(r"[A-Z][A-Z0-9_]{0,12}", fullmatch=True).filter(
    lambda n: (
        n not in {"POD_IP", "POD_NAME", "POD_NAMESPACE", "NODE_NAME", "OMNISTAGE_STAGE"}
        and n != "NVIDIA_VISIBLE_DEVICES"
    )
)
label_keys = st.from_regex(r"[a-z]{1,8}(\.[a-z]{2,5}/[a-z]{1,8})?", fullmatch=True).filter(
    lambda k: k not in RESERVED_LABELS
)


@st.composite
def stage_bodies(draw: st.DrawFn) -> dict[str, Any]:
    runner, backend = draw(
        st.sampled_from([("Diffusion", "Diffusers"), ("AR", "Transformers"), ("AR", "VLLM")])
    )
    mount = draw(st.sampled_from(["/models", "/mnt/m", "/tmp/omnistage-demo/models"]))
    model: dict[str, Any] = {"path": f"{mount}/{draw(dns)}", "mountPath": mount}
    if draw(st.booleans()):
        model["volume"] = {"hostPath": {"path": "/data"}}
    gpus = draw(st.integers(0, 8))
    placement: dict[str, Any] = {"mode": "DRA"}
    if draw(st.booleans()):
        devices = draw(
            st.lists(st.sampled_from([str(i) for i in range(8)]), min_size=1, unique=True)
        )
        placement = {"mode": "Explicit", "nodeName": draw(dns), "devices": devices}
    env = [
        {"name": n, "value": draw(st.text(max_size=5))}
        for n in draw(st.lists(env_names, max_size=3))
    ]
    volumes = [{"name": f"v{i}", "emptyDir": {}} for i in range(draw(st.integers(0, 3)))]
    return {
        "apiVersion": "omnistage.io/v1alpha1",
        "kind": "OmniStage",
        "metadata": {"name": draw(dns), "namespace": draw(dns), "uid": "u-1", "generation": 1},
        "spec": {
            "runner": runner,
            "backend": backend,
            "image": "img:1",
            "model": model,
            "state": draw(st.sampled_from(["Active", "Asleep"])),
            "sleepLevel": draw(st.sampled_from([1, 2])),
            "colocation": {"group": draw(dns), "priority": draw(st.integers(-1000, 1000))},
            "gpus": gpus,
            "placement": placement,
            "worker": {
                "port": draw(st.integers(1024, 65535)),
                "device": draw(st.sampled_from(["auto", "cpu", "cuda"])),
                "args": draw(st.lists(st.sampled_from(["--steps", "4", "--x=y"]), max_size=3)),
            },
            "template": {
                "env": env,
                "volumes": volumes,
                "volumeMounts": [
                    {"name": v["name"], "mountPath": f"/{v['name']}"} for v in volumes
                ],
                "labels": draw(st.dictionaries(label_keys, dns, max_size=3)),
            },
        },
    }


@settings(max_examples=80, deadline=None)
@given(stage_bodies(), st.sampled_from(list(DesiredState)))
def test_pod_invariants(body: dict[str, Any], initial: DesiredState) -> None:
    stage = parse_stage(body)
    owner = owner_reference(body)
    pod = build_worker_pod(stage, initial_state=initial, owner=owner)
    text = json.dumps(pod)
    assert TOKEN not in text

    meta, spec = pod["metadata"], pod["spec"]
    assert meta["labels"]["omnistage.io/stage"] == stage.name
    assert meta["labels"]["omnistage.io/group"] == stage.group
    assert meta["ownerReferences"] == [owner]
    for key, value in stage.template.labels.items():
        assert meta["labels"][key] == value

    (c,) = spec["containers"]
    args = c["args"]

    def flag(name: str) -> str:
        value: str = args[args.index(name) + 1]
        return value

    assert flag("--runner") == stage.runner.cli
    assert flag("--backend") == stage.backend.cli
    assert flag("--model") == stage.model.path
    assert flag("--port") == str(stage.worker.port)
    assert flag("--initial-state") == initial.cli
    prewarmed = stage.backend is Backend.VLLM and initial is DesiredState.ASLEEP
    assert flag("--sleep-level") == str(2 if prewarmed else stage.sleep_level)
    assert flag("--device") == worker_device(stage) in {"cpu", "cuda"}
    assert args[-len(stage.worker.args) or len(args) :] == (list(stage.worker.args) or [])
    assert c["readinessProbe"]["grpc"]["port"] == c["livenessProbe"]["grpc"]["port"]
    assert c["ports"][0]["containerPort"] == stage.worker.port

    env_names = [e["name"] for e in c["env"]]
    assert env_names[:5] == ["POD_IP", "POD_NAME", "POD_NAMESPACE", "NODE_NAME", "OMNISTAGE_STAGE"]
    assert env_names[-len(stage.template.env) or len(env_names) :] == [
        e["name"] for e in stage.template.env
    ]

    volume_names = [v["name"] for v in spec["volumes"]]
    assert len(volume_names) == len(set(volume_names))
    assert {m["name"] for m in c["volumeMounts"]} <= set(volume_names)

    if stage.placement.mode is PlacementMode.EXPLICIT:
        assert spec["nodeName"] == stage.placement.node_name
        assert "resourceClaims" not in spec
        assert "NVIDIA_VISIBLE_DEVICES" in env_names
    elif stage.gpus > 0:
        assert spec["resourceClaims"] == [
            {"name": "gpus", "resourceClaimName": claim_name(stage.group)}
        ]
        assert c["resources"]["claims"] == [{"name": "gpus"}]
    else:
        assert "resourceClaims" not in spec

    svc = build_service(stage, owner=owner)
    assert svc["spec"]["selector"].items() <= meta["labels"].items()
