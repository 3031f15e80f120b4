"""The CRD file agrees with the Python spec model, and the examples fit both.

The API server's own verdict on bad manifests is tested in tests/e2e/test_crd_validation.py;
these checks are the fast, offline part: names, printer columns, enums, defaults and bounds
must be the same in the schema and in ``omnistage_operator.api.spec``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from omnistage_operator.api import spec as S
from omnistage_operator.api.conditions import ConditionStatus
from omnistage_operator.api.spec_parse import parse_stage
from omnistage_operator.decisions import status
from omnistage_worker.quantities import QUANTITY_PATTERN
from tests.examples import MANIFESTS, stage_docs

ROOT = Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "crds" / "omnistages.omnistage.io.yaml"
EXAMPLES = MANIFESTS


@pytest.fixture(scope="module")
def crd() -> dict[str, Any]:
    data = yaml.safe_load(CRD_PATH.read_text())
    assert isinstance(data, dict)
    return data


@pytest.fixture(scope="module")
def version(crd: dict[str, Any]) -> dict[str, Any]:
    (v,) = crd["spec"]["versions"]
    assert isinstance(v, dict)
    return v


@pytest.fixture(scope="module")
def root(version: dict[str, Any]) -> dict[str, Any]:
    schema = version["schema"]["openAPIV3Schema"]
    assert isinstance(schema, dict)
    return schema


def prop(schema: dict[str, Any], dotted: str) -> dict[str, Any]:
    node = schema
    for part in dotted.split("."):
        node = node["properties"][part]
    return node


def test_names(crd: dict[str, Any], version: dict[str, Any]) -> None:
    assert crd["apiVersion"] == "apiextensions.k8s.io/v1"
    assert crd["metadata"]["name"] == f"{S.PLURAL}.{S.GROUP}"
    assert crd["spec"]["group"] == S.GROUP
    names = crd["spec"]["names"]
    assert names["kind"] == S.KIND and names["plural"] == S.PLURAL
    assert names["shortNames"] == ["ost"]
    assert crd["spec"]["scope"] == "Namespaced"
    assert version["name"] == S.VERSION and version["served"] and version["storage"]
    assert version["subresources"] == {"status": {}}


def test_printer_columns(version: dict[str, Any]) -> None:
    default_columns = [
        (c["name"].upper(), c["jsonPath"])
        for c in version["additionalPrinterColumns"]
        if c.get("priority", 0) == 0
    ]
    assert default_columns == [
        ("STATE", ".status.state"),
        ("LEVEL", ".status.sleepLevel"),
        ("GROUP", ".spec.colocation.group"),
        ("USED", ".status.memory.used"),
        ("FREED", ".status.lastAck.freed"),
        ("NODE", ".status.node"),
        ("WAITING", ".status.waitReason"),  # why a stage that wants Active is not woken
        ("AGE", ".metadata.creationTimestamp"),
    ]


@pytest.mark.parametrize(
    ("dotted", "values"),
    [
        ("spec.runner", [m.value for m in S.Runner]),
        ("spec.backend", [m.value for m in S.Backend]),
        ("spec.state", [m.value for m in S.DesiredState]),
        ("spec.placement.mode", [m.value for m in S.PlacementMode]),
        ("spec.worker.device", [m.value for m in S.WorkerDevice]),
        ("spec.worker.dtype", list(S.DTYPES)),
        ("status.state", [m.value for m in status.Phase]),
        ("status.memory.source", [m.value for m in status.MemorySource]),
    ],
)
def test_enums_match_python(root: dict[str, Any], dotted: str, values: list[str]) -> None:
    assert prop(root, dotted)["enum"] == values


def test_condition_status_enum(root: dict[str, Any]) -> None:
    items = prop(root, "status.conditions")["items"]
    assert items["properties"]["status"]["enum"] == [m.value for m in ConditionStatus]
    conditions = prop(root, "status.conditions")
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]


@pytest.mark.parametrize(
    ("dotted", "default", "low", "high"),
    [
        ("spec.sleepLevel", S.DEFAULT_SLEEP_LEVEL, 1, 2),
        ("spec.colocation.priority", S.DEFAULT_PRIORITY, S.MIN_PRIORITY, S.MAX_PRIORITY),
        ("spec.gpus", S.DEFAULT_GPUS, 0, S.MAX_GPUS),
        ("spec.worker.port", S.DEFAULT_PORT, S.MIN_PORT, S.MAX_PORT),
        (
            "spec.drainTimeoutSeconds",
            S.DEFAULT_DRAIN_TIMEOUT_S,
            S.MIN_DRAIN_TIMEOUT_S,
            S.MAX_DRAIN_TIMEOUT_S,
        ),
    ],
)
def test_integer_defaults_and_bounds(
    root: dict[str, Any], dotted: str, default: int, low: int, high: int
) -> None:
    node = prop(root, dotted)
    assert node["type"] == "integer"
    assert (node["default"], node["minimum"], node["maximum"]) == (default, low, high)


def test_string_defaults(root: dict[str, Any]) -> None:
    assert prop(root, "spec.state")["default"] == S.DesiredState.ACTIVE.value
    assert prop(root, "spec.model.mountPath")["default"] == S.DEFAULT_MOUNT_PATH
    assert prop(root, "spec.placement.mode")["default"] == S.PlacementMode.DRA.value
    # Parents default to {} so their children's defaults are applied.
    assert prop(root, "spec.placement")["default"] == {"mode": S.PlacementMode.DRA.value}
    assert prop(root, "spec.worker")["default"] == {}


def test_required(root: dict[str, Any]) -> None:
    assert root["required"] == ["spec"]
    assert prop(root, "spec")["required"] == ["runner", "backend", "model", "image", "colocation"]
    assert prop(root, "spec.model")["required"] == ["path"]
    assert prop(root, "spec.colocation")["required"] == ["group"]


def test_quantity_pattern_is_the_parsers(root: dict[str, Any]) -> None:
    request = prop(root, "spec.vram.request")
    assert request["pattern"] == QUANTITY_PATTERN
    assert request["x-kubernetes-int-or-string"] is True


def test_group_pattern_is_a_dns_label(root: dict[str, Any]) -> None:
    group = prop(root, "spec.colocation.group")
    assert group["maxLength"] == 63
    assert re.fullmatch(group["pattern"], "gpu-0")
    assert not re.fullmatch(group["pattern"], "Gpu_0")


def _walk(node: dict[str, Any], path: str) -> list[tuple[str, dict[str, Any]]]:
    out = [(path, node)]
    for name, child in (node.get("properties") or {}).items():
        out += _walk(child, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        out += _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        out += _walk(node["additionalProperties"], f"{path}{{}}")
    return out


def test_schema_is_structural(root: dict[str, Any]) -> None:
    for path, node in _walk(root, "$"):
        if node.get("x-kubernetes-int-or-string"):
            assert "type" not in node, path
            continue
        assert node.get("type") in {"object", "array", "string", "integer", "number", "boolean"}, (
            path
        )
        for name in node.get("required", []):
            assert name in node.get("properties", {}), f"{path} requires unknown {name}"


def test_every_cel_rule_explains_itself(root: dict[str, Any]) -> None:
    rules = [
        (path, rule)
        for path, node in _walk(root, "$")
        for rule in node.get("x-kubernetes-validations", [])
    ]
    assert len(rules) >= 8
    for path, rule in rules:
        assert rule["message"].strip(), path
        if "fieldPath" in rule:  # the API server prefixes the message with the field
            assert rule["fieldPath"].startswith("."), path
        else:  # the message itself must name the field
            assert "spec." in rule["message"] or "metadata." in rule["message"], path
        if "reason" in rule:
            assert rule["reason"] in {
                "FieldValueInvalid",
                "FieldValueForbidden",
                "FieldValueRequired",
                "FieldValueDuplicate",
            }


def test_reserved_names_in_the_cel_rules_are_the_operators() -> None:
    """The CRD's lists of reserved worker flags and env names are spec.py's (and every worker
    flag the operator writes is among them), so the two never drift apart."""
    import re

    from omnistage_operator.api.spec import (
        RESERVED_ARG_PREFIXES,
        RESERVED_ARGS,
        RESERVED_ENV,
        DesiredState,
    )
    from omnistage_operator.api.spec_parse import parse_stage
    from omnistage_operator.k8s.worker_command import worker_args

    text = CRD_PATH.read_text()
    args_rule = text[text.index("self.all(a, !a.startsWith('--')") :]
    args_rule = args_rule[: args_rule.index("message:")]
    listed = set(re.findall(r"'(--[a-z-]+)'", args_rule))
    assert listed == set(RESERVED_ARGS) | set(RESERVED_ARG_PREFIXES)
    env_rule = text[text.index("!(self.name in ['POD_IP'") :]
    env_rule = env_rule[: env_rule.index("message:")]
    assert set(re.findall(r"'([A-Z_]+)'", env_rule)) == set(RESERVED_ENV)
    body = {
        "metadata": {"name": "s", "namespace": "ns", "uid": "u", "generation": 1},
        "spec": {
            "runner": "AR", "backend": "Transformers", "image": "i", "gpus": 2,
            "model": {"path": "/models/m"}, "colocation": {"group": "g"},
            "activation": {"policy": "OnDemand"},
        },
    }  # fmt: skip
    written = worker_args(parse_stage(body), initial_state=DesiredState.ASLEEP, epoch=3)
    flags = {a.split("=")[0] for a in written if a.startswith("--")}
    assert flags <= set(RESERVED_ARGS), flags - set(RESERVED_ARGS)


# --- a small strict validator: enough of OpenAPI to check that the examples fit the schema ---


_TYPES: dict[str, type | tuple[type, ...]] = {
    "object": dict,
    "array": list,
    "string": str,
    "integer": int,
    "number": (int, float),
    "boolean": bool,
}


def _is_type(kind: str, value: object) -> bool:
    if kind in {"integer", "number"} and isinstance(value, bool):
        return False
    return isinstance(value, _TYPES[kind])


def _check(schema: dict[str, Any], value: Any, path: str) -> list[str]:
    errors: list[str] = []
    if schema.get("x-kubernetes-int-or-string"):
        if isinstance(value, str) and "pattern" in schema:
            if not re.search(schema["pattern"], value):
                errors.append(f"{path}: does not match pattern")
        elif not isinstance(value, int | str):
            errors.append(f"{path}: not int-or-string")
        return errors
    kind = str(schema.get("type"))
    if not _is_type(kind, value):
        return [f"{path}: expected {kind}"]
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} not in enum")
    if "minimum" in schema and value < schema["minimum"]:
        errors.append(f"{path}: below minimum")
    if "maximum" in schema and value > schema["maximum"]:
        errors.append(f"{path}: above maximum")
    if kind == "string":
        if "pattern" in schema and not re.search(schema["pattern"], value):
            errors.append(f"{path}: does not match {schema['pattern']}")
        if len(value) > schema.get("maxLength", 10**9) or len(value) < schema.get("minLength", 0):
            errors.append(f"{path}: length out of bounds")
    if kind == "array":
        if len(value) > schema.get("maxItems", 10**9):
            errors.append(f"{path}: too many items")
        for i, item in enumerate(value):
            errors += _check(schema["items"], item, f"{path}[{i}]")
    if kind == "object":
        props = schema.get("properties", {})
        for name in schema.get("required", []):
            if name not in value:
                errors.append(f"{path}.{name}: required")
        for key, item in value.items():
            if key in props:
                errors += _check(props[key], item, f"{path}.{key}")
            elif isinstance(schema.get("additionalProperties"), dict):
                errors += _check(schema["additionalProperties"], item, f"{path}.{key}")
            elif not schema.get("x-kubernetes-preserve-unknown-fields") and path != "$.metadata":
                errors.append(f"{path}.{key}: unknown field")
    return errors


def _example_docs() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path, doc in stage_docs():
        docs.append((f"{path.relative_to(ROOT)}:{doc['metadata']['name']}", doc))
    return docs


def test_examples_exist() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in EXAMPLES}
    assert {
        "examples/gpu/two-stage-group.yaml",
        "examples/cpu/tiny-llama.yaml",
        "examples/cpu/tiny-diffusion.yaml",
    } <= names
    for path in EXAMPLES:
        assert path.read_text().startswith("#"), f"{path} needs its explanatory header"


@pytest.mark.parametrize(
    ("where", "doc"), _example_docs(), ids=lambda x: x if isinstance(x, str) else ""
)
def test_examples_fit_schema_and_parse(
    root: dict[str, Any], where: str, doc: dict[str, Any]
) -> None:
    assert _check(root, doc, "$") == [], where
    stage = parse_stage(doc)
    assert stage.vram_request_bytes is not None and stage.vram_request_bytes > 0


def test_cpu_examples_form_the_demo_group() -> None:
    stages = [parse_stage(d) for w, d in _example_docs() if w.startswith("examples/cpu/")]
    assert {s.group for s in stages} == {"demo"}
    assert {s.runner for s in stages} == {S.Runner.AR, S.Runner.DIFFUSION}
    assert all(s.worker.device is S.WorkerDevice.CPU and s.gpus == 1 for s in stages)
    assert all(s.model.path.startswith("/tmp/omnistage-demo/models/") for s in stages)
    # exactly one asks for the memory at first
    assert sorted(s.state.value for s in stages) == ["Active", "Asleep"]


def test_validator_catches_a_bad_doc(root: dict[str, Any]) -> None:
    _, doc = _example_docs()[0]
    bad = yaml.safe_load(yaml.safe_dump(doc))
    bad["spec"]["gpus"] = 9
    bad["spec"]["colour"] = "blue"
    errors = _check(root, bad, "$")
    assert "$.spec.gpus: above maximum" in errors
    assert "$.spec.colour: unknown field" in errors
