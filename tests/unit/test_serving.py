"""``spec.limits`` and ``spec.http``: parsed, refused naming the field, passed to the worker as
reserved flags and a read-only Secret volume, bounded the same in the CRD."""

from __future__ import annotations

import re
from typing import Any

import pytest

from omnistage_operator.api import serving as V
from omnistage_operator.api.spec import RESERVED_ARGS, RESERVED_VOLUMES, DesiredState, SpecError
from omnistage_operator.k8s.builders import build_worker_pod
from omnistage_operator.k8s.pod_hash import pod_spec_hash
from omnistage_operator.k8s.worker_command import worker_args
from omnistage_worker import config as worker_config
from omnistage_worker import limits as worker_limits
from omnistage_worker.cli import build_parser
from omnistage_worker.flag_groups import request_limits
from tests.unit.stage_bodies import container, make
from tests.unit.test_crd import CRD_PATH, prop

LIMITS = {
    "requestBodyBytes": 4096,
    "promptTokens": 100,
    "imageSide": 512,
    "frames": 17,
    "maxBatch": 8,
}
AUTH = {"authSecret": {"name": "llm-api", "key": "api-token"}}


def test_defaults_are_the_workers() -> None:
    stage, _ = make()
    assert stage.serving == V.Serving()
    assert (
        V.DEFAULT_REQUEST_BODY_BYTES,
        V.DEFAULT_PROMPT_TOKENS,
        V.DEFAULT_IMAGE_SIDE,
        V.DEFAULT_FRAMES,
        V.DEFAULT_MAX_BATCH,
        V.BOUNDS["maxBatch"][1],
    ) == (
        worker_limits.DEFAULT_REQUEST_BODY_BYTES,
        worker_limits.DEFAULT_PROMPT_TOKENS,
        worker_limits.DEFAULT_IMAGE_SIDE,
        worker_limits.DEFAULT_FRAMES,
        worker_config.DEFAULT_MAX_BATCH,
        worker_config.MAX_BATCH,
    )
    # a default stage's worker flags and pod hash are as before these fields existed
    assert not set(worker_args(stage, initial_state=DesiredState.ACTIVE)) & V.SERVING_ARGS


def test_limits_and_auth_become_worker_flags_and_a_secret_volume() -> None:
    stage, owner = make(limits=LIMITS, http=AUTH)
    args = worker_args(stage, initial_state=DesiredState.ACTIVE)
    token_file = f"{V.HTTP_TOKEN_DIR}/api-token"
    # the worker's own parser reads them back as the same limits
    parsed = build_parser({}).parse_args(args)
    assert request_limits(parsed) == worker_limits.RequestLimits(4096, 100, 512, 17)
    assert parsed.max_batch == 8
    assert parsed.http_token_file is not None and str(parsed.http_token_file) == token_file
    pod = build_worker_pod(stage, initial_state=DesiredState.ACTIVE, owner=owner)
    mounts = {m["name"]: m for m in container(pod)["volumeMounts"]}
    assert mounts[V.HTTP_TOKEN_VOLUME] == {
        "name": V.HTTP_TOKEN_VOLUME,
        "mountPath": V.HTTP_TOKEN_DIR,
        "readOnly": True,
    }
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == V.HTTP_TOKEN_VOLUME)
    assert volume["secret"]["secretName"] == "llm-api"
    assert volume["secret"]["items"] == [{"key": "api-token", "path": "api-token"}]
    assert pod_spec_hash(stage) != pod_spec_hash(make()[0])  # a change needs a new pod
    assert V.SERVING_ARGS <= RESERVED_ARGS and V.HTTP_TOKEN_VOLUME in RESERVED_VOLUMES


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"limits": {"promptTokens": 0}}, "spec.limits.promptTokens"),
        ({"limits": {"imageSide": 16385}}, "spec.limits.imageSide"),
        ({"limits": {"frames": "many"}}, "spec.limits.frames"),
        ({"limits": {"maxBatch": 0}}, "spec.limits.maxBatch"),
        ({"limits": {"maxBatch": 1025}}, "spec.limits.maxBatch"),
        ({"limits": {"requestBodyBytes": 10}}, "spec.limits.requestBodyBytes"),
        ({"limits": {"tokens": 5}}, "spec.limits.tokens"),
        ({"limits": []}, "spec.limits"),
        ({"http": {"authSecret": {"name": "Bad_Name"}}}, "spec.http.authSecret.name"),
        ({"http": {"authSecret": {"name": "ok", "key": "a/b"}}}, "spec.http.authSecret.key"),
    ],
)
def test_bad_fields_are_named(spec: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError) as info:
        make(**spec)
    assert info.value.field == field


def _crd_root() -> dict[str, Any]:
    import yaml

    crd = yaml.safe_load(CRD_PATH.read_text())
    root: dict[str, Any] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return root


def test_crd_bounds_and_defaults_are_the_parsers() -> None:
    root = _crd_root()
    defaults = V.Serving()
    for key, (low, high) in V.BOUNDS.items():
        node = prop(root, f"spec.limits.{key}")
        assert (node["type"], node["minimum"], node["maximum"]) == ("integer", low, high)
    assert prop(root, "spec.limits.requestBodyBytes")["default"] == defaults.request_body_bytes
    assert prop(root, "spec.limits.promptTokens")["default"] == defaults.prompt_tokens
    assert prop(root, "spec.limits.imageSide")["default"] == defaults.image_side
    assert prop(root, "spec.limits.frames")["default"] == defaults.frames
    assert prop(root, "spec.limits.maxBatch")["default"] == defaults.max_batch
    assert prop(root, "spec.http.authSecret")["required"] == ["name"]
    assert prop(root, "spec.http.authSecret.key")["default"] == V.DEFAULT_AUTH_KEY


def test_crd_refuses_the_serving_flags_in_worker_args() -> None:
    """The reserved-flag rule on spec.worker.args lists every serving flag; it refuses a flag
    that is a prefix of a listed one (with or without ``=value``) and lets the user's own
    flags through (the real API server runs it in tests/e2e/test_serving_limits.py)."""
    rules = prop(_crd_root(), "spec.worker.args")["x-kubernetes-validations"]
    (rule,) = [r["rule"] for r in rules if "].exists(r, r.startsWith(" in r["rule"]]
    listed = re.findall(r"'(--[a-z-]+)'", rule[: rule.index("].exists")])

    def refused(arg: str) -> bool:  # the rule's own logic, for one argument
        name = arg.split("=", maxsplit=1)[0]
        return any(r.startswith(name) for r in listed)

    for flag in sorted(V.SERVING_ARGS):
        for arg in (flag, f"{flag}=1", flag[:-2]):
            assert refused(arg), arg
    assert not refused("--max-held")
    assert not refused("--max-held=8")


def test_chart_router_requires_the_stages_token() -> None:
    from tests.unit.test_chart_support import render

    group = {"name": "demo", "stages": ["llm"], "authSecret": {"name": "llm-api", "key": "k"}}
    objs = render({"router": {"enabled": True, "groups": [group]}})
    deployment = next(
        o for o in objs if o["kind"] == "Deployment" and "-router-" in o["metadata"]["name"]
    )
    pod = deployment["spec"]["template"]["spec"]
    (router,) = pod["containers"]
    assert f"--token-file={V.HTTP_TOKEN_DIR}/k" in router["args"]
    assert router["volumeMounts"] == [
        {"name": V.HTTP_TOKEN_VOLUME, "mountPath": V.HTTP_TOKEN_DIR, "readOnly": True}
    ]
    (volume,) = pod["volumes"]
    assert volume["secret"]["secretName"] == "llm-api"
    assert volume["secret"]["items"] == [{"key": "k", "path": "k"}]
