"""The real API server enforces the OmniStage schema: bad manifests are refused naming the field.

Runs against the local control plane (``control_plane`` and ``namespace`` fixtures from
tests/cluster/pytest_plugin.py). Each bad manifest is a small change to a good one, applied
with ``kubectl apply`` (``--validate=strict`` so unknown fields are errors too); the test
checks the refusal names the field and says why, and that nothing was stored. It also
server-side dry-runs the children the builders make (pod, Service, claim, Secret).
"""

from __future__ import annotations

import copy
import json
import subprocess
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from omnistage_operator.api.conditions import MEMORY_RELEASED, READY, Reason, set_condition
from omnistage_operator.api.spec import DesiredState, PlacementMode
from omnistage_operator.api.spec_parse import parse_stage
from omnistage_operator.k8s.builders import (
    build_group_claim,
    build_service,
    build_worker_pod,
    owner_reference,
)
from omnistage_operator.k8s.token_secret import build_token_secret
from omnistage_operator.k8s.worker_command import vllm_args
from omnistage_worker.quantities import format_bytes
from tests.cluster.controlplane import ControlPlane
from tests.examples import stage_docs

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "crds" / "omnistages.omnistage.io.yaml"
NOW = datetime(2026, 11, 21, 5, 0, tzinfo=UTC)


def good(name: str = "stage") -> dict[str, Any]:
    return {
        "apiVersion": "omnistage.io/v1alpha1",
        "kind": "OmniStage",
        "metadata": {"name": name},
        "spec": {
            "runner": "AR",
            "backend": "Transformers",
            "image": "omnistage/omnistage-worker:0.1.0",
            "model": {"path": "/models/tiny-llama"},
            "colocation": {"group": "g1"},
        },
    }


@pytest.fixture
def cluster(control_plane: ControlPlane) -> ControlPlane:
    """The control plane with the CRD applied and established."""
    control_plane.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD))
    control_plane.wait_crd_established("omnistages.omnistage.io")
    return control_plane


def apply(
    cp: ControlPlane, namespace: str, manifest: dict[str, Any], check: bool = True
) -> subprocess.CompletedProcess[str]:
    return cp.kubectl(
        "apply", "--validate=strict", "-n", namespace, "-f", "-", input=json.dumps(manifest),
        check=check,
    )  # fmt: skip


def get(cp: ControlPlane, namespace: str, name: str) -> dict[str, Any]:
    out = cp.kubectl("get", "omnistage", name, "-n", namespace, "-o", "json").stdout
    data: dict[str, Any] = json.loads(out)
    return data


Mutation = Callable[[dict[str, Any]], None]


def _set(path: str, value: Any) -> Mutation:
    def mutate(m: dict[str, Any]) -> None:
        node = m
        *parents, last = path.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value

    return mutate


def _drop(path: str) -> Mutation:
    def mutate(m: dict[str, Any]) -> None:
        node = m
        *parents, last = path.split(".")
        for p in parents:
            node = node[p]
        del node[last]

    return mutate


def _vllm(block: dict[str, Any]) -> Mutation:
    def mutate(m: dict[str, Any]) -> None:
        m["spec"]["backend"] = "VLLM"
        m["spec"]["vllm"] = block

    return mutate


# (id, mutation, substrings the refusal must contain: the field, then why)
BAD: list[tuple[str, Mutation, tuple[str, ...]]] = [
    ("wrong-runner-enum", _set("spec.runner", "GAN"), ("spec.runner", "Unsupported value")),
    ("wrong-state-enum", _set("spec.state", "Sleeping"), ("spec.state", "Unsupported value")),
    ("missing-image", _drop("spec.image"), ("spec.image", "Required value")),
    ("missing-colocation", _drop("spec.colocation"), ("spec.colocation", "Required value")),
    ("missing-model-path", _set("spec.model", {}), ("spec.model.path", "Required value")),
    (
        "priority-out-of-range",
        _set("spec.colocation.priority", 5000),
        ("spec.colocation.priority", "less than or equal to 1000"),
    ),
    ("sleep-level-3", _set("spec.sleepLevel", 3), ("spec.sleepLevel", "less than or equal to 2")),
    (
        "sleep-level-0",
        _set("spec.sleepLevel", 0),
        ("spec.sleepLevel", "greater than or equal to 1"),
    ),
    ("port-too-low", _set("spec.worker.port", 80), ("spec.worker.port", "greater than or equal")),
    ("port-too-high", _set("spec.worker.port", 70000), ("spec.worker.port", "less than or equal")),
    ("gpus-over-8", _set("spec.gpus", 9), ("spec.gpus", "less than or equal to 8")),
    (
        "diffusion-with-transformers",
        _set("spec.runner", "Diffusion"),
        ("spec.backend", "runner Diffusion needs backend Diffusers"),
    ),
    (
        "ar-with-diffusers",
        _set("spec.backend", "Diffusers"),
        ("spec.backend", "runner AR needs backend Transformers or VLLM"),
    ),
    (
        "explicit-without-devices",
        _set("spec.placement", {"mode": "Explicit", "nodeName": "gpu-node-1"}),
        ("spec.placement.devices", "needs at least one device"),
    ),
    (
        "explicit-without-node",
        _set("spec.placement", {"mode": "Explicit", "devices": ["0"]}),
        ("spec.placement.nodeName", "is required when spec.placement.mode is Explicit"),
    ),
    (
        "bad-group-name",
        _set("spec.colocation.group", "Bad_Group"),
        ("spec.colocation.group", "should match"),
    ),
    ("bad-vram-quantity", _set("spec.vram.request", "16GB"), ("spec.vram.request", "should match")),
    ("zero-vram", _set("spec.vram.request", "0"), ("spec.vram.request", "positive quantity")),
    (
        "unknown-field-strict",
        _set("spec.colour", "blue"),
        ('unknown field "spec.colour"',),
    ),
    (
        "relative-model-path",
        _set("spec.model.path", "models/x"),
        ("spec.model.path", "should match"),
    ),
    (
        "model-path-outside-mount",
        _set("spec.model", {"path": "/data/x", "volume": {"emptyDir": {}}}),
        ("spec.model.path", "must be under spec.model.mountPath"),
    ),
    (
        "reserved-worker-flag",
        _set("spec.worker.args", ["--port=1"]),
        ("spec.worker.args", "must not set, or abbreviate, a flag the operator"),
    ),
    (
        "reserved-env",
        _set("spec.template.env", [{"name": "POD_IP", "value": "1.2.3.4"}]),
        ("spec.template.env[0].name", "must not set a variable the operator sets"),
    ),
    (
        "reserved-label",
        _set("spec.template.labels", {"omnistage.io/group": "other"}),
        ("spec.template.labels", "set by the operator"),
    ),
    (
        "name-too-long",
        _set("metadata.name", "s" * 57),
        ("metadata.name", "at most 56 characters"),
    ),
    ("bad-dtype", _set("spec.worker.dtype", "int4"), ("spec.worker.dtype", "Unsupported value")),
    ("missing-runner", _drop("spec.runner"), ("spec.runner", "Required value")),
    ("missing-model", _drop("spec.model"), ("spec.model", "Required value")),
    ("missing-group", _set("spec.colocation", {}), ("spec.colocation.group", "Required value")),
    ("sleep-level-string", _set("spec.sleepLevel", "1"), ("spec.sleepLevel", "integer")),
    (
        "placement-mode-enum",
        _set("spec.placement.mode", "Static"),
        ("spec.placement.mode", "Unsupported value"),
    ),
    (
        "repeated-device",
        _set("spec.placement", {"mode": "Explicit", "nodeName": "n", "devices": ["0", "0"]}),
        ("spec.placement.devices[1]", "Duplicate value"),
    ),
    (
        "worker-device-enum",
        _set("spec.worker.device", "tpu"),
        ("spec.worker.device", "Unsupported value"),
    ),
    (
        "reserved-drain-timeout-flag",
        _set("spec.worker.args", ["--drain-timeout=5"]),
        ("spec.worker.args", "--drain-timeout, --activation, --hold-timeout, --http-port"),
    ),
    (
        "reserved-activation-flag",
        _set("spec.worker.args", ["--activation=ondemand"]),
        ("spec.worker.args", "sets from the spec"),
    ),
    ("args-not-a-list", _set("spec.worker.args", "--x"), ("spec.worker.args", "array")),
    (
        "drain-timeout-0",
        _set("spec.drainTimeoutSeconds", 0),
        ("spec.drainTimeoutSeconds", "greater than or equal to 1"),
    ),
    (
        "drain-timeout-over-a-day",
        _set("spec.drainTimeoutSeconds", 86401),
        ("spec.drainTimeoutSeconds", "less than or equal to 86400"),
    ),
    (
        "env-without-name",
        _set("spec.template.env", [{"value": "x"}]),
        ("spec.template.env[0].name", "Required value"),
    ),
    (
        "reserved-volume-name",
        _set("spec.template.volumes", [{"name": "model", "emptyDir": {}}]),
        ("spec.template.volumes[0].name", "the operator's own volumes"),
    ),
    (
        "claims-in-template-resources",
        _set("spec.template.resources", {"claims": [{"name": "x"}]}),
        ('unknown field "spec.template.resources.claims"',),
    ),
    (
        "node-selector-not-string",
        _set("spec.template.nodeSelector", {"a": 1}),
        ("spec.template.nodeSelector.a", "string"),
    ),
    (
        "model-mount-over-token",
        _set("spec.model.mountPath", "/var/run/secrets/omnistage"),
        ("spec.model.mountPath", "must not be under /var/run/secrets/omnistage"),
    ),
    (
        "model-path-in-sibling-of-mount",
        _set("spec.model", {"path": "/models2/x", "volume": {"emptyDir": {}}}),
        ("spec.model.path", "must be under spec.model.mountPath"),
    ),
    ("name-upper-case", _set("metadata.name", "Has-Upper"), ("metadata.name", "DNS-1035")),
    ("name-digit-first", _set("metadata.name", "9lives"), ("metadata.name", "DNS-1035")),
    (
        "activation-policy-enum",
        _set("spec.activation", {"policy": "Lazy"}),
        ("spec.activation.policy", "Unsupported value"),
    ),
    (
        "activation-idle-after-on-manual",
        _set("spec.activation", {"idleAfter": "5m"}),
        ("spec.activation", "apply only to policy OnDemand"),
    ),
    (
        "activation-duration-format",
        _set("spec.activation", {"policy": "OnDemand", "holdTimeout": "5 minutes"}),
        ("spec.activation.holdTimeout", "should match"),
    ),
    (
        "activation-hold-timeout-too-short",
        _set("spec.activation", {"policy": "OnDemand", "holdTimeout": "10ms"}),
        ("spec.activation.holdTimeout", "must be between 100ms and 1h"),
    ),
    (
        "activation-idle-after-too-long",
        _set("spec.activation", {"policy": "OnDemand", "idleAfter": "200h"}),
        ("spec.activation.idleAfter", "must be between 1s and 168h"),
    ),
    (
        "http-port-equals-grpc-port",
        _set("spec.worker", {"port": 8000, "httpPort": 8000}),
        ("spec.worker.httpPort", "must differ from spec.worker.port"),
    ),
    (
        "metrics-port-equals-http-port",
        _set("spec.worker", {"httpPort": 9000, "metricsPort": 9000}),
        ("spec.worker.metricsPort", "must differ from spec.worker.port and httpPort"),
    ),
    (
        "vllm-block-on-transformers",
        _set("spec.vllm", {"enforceEager": True}),
        ("spec.vllm", "is for backend VLLM only"),
    ),
    (
        "vllm-utilization-zero",
        _vllm({"gpuMemoryUtilization": 0}),
        ("spec.vllm.gpuMemoryUtilization", "greater than 0"),
    ),
    (
        "vllm-utilization-over-one",
        _vllm({"gpuMemoryUtilization": 1.5}),
        ("spec.vllm.gpuMemoryUtilization", "less than or equal to 1"),
    ),
    (
        "vllm-max-model-len-zero",
        _vllm({"maxModelLen": 0}),
        ("spec.vllm.maxModelLen", "greater than or equal to 1"),
    ),
    (
        "vllm-max-num-seqs-zero",
        _vllm({"maxNumSeqs": 0}),
        ("spec.vllm.maxNumSeqs", "greater than or equal to 1"),
    ),
    (
        "vllm-kv-cache-dtype-unknown",
        _vllm({"kvCacheDtype": "int3"}),
        ("spec.vllm.kvCacheDtype", "Unsupported value"),
    ),
    (
        "vllm-prefix-caching-not-bool",
        _vllm({"enablePrefixCaching": "yes"}),
        ("spec.vllm.enablePrefixCaching", "boolean"),
    ),
    (
        "vllm-tensor-parallel-size-not-gpus",
        _vllm({"tensorParallelSize": 2}),
        ("spec.vllm.tensorParallelSize", "must equal spec.gpus"),
    ),
    (
        "vllm-auto-tool-choice-without-parser",
        _vllm({"enableAutoToolChoice": True}),
        ("spec.vllm.toolCallParser", "is required when spec.vllm.enableAutoToolChoice"),
    ),
    (
        "vllm-tool-parser-without-auto-tool-choice",
        _vllm({"toolCallParser": "hermes"}),
        ("spec.vllm.toolCallParser", "needs spec.vllm.enableAutoToolChoice true"),
    ),
    (
        "vllm-tool-parser-not-a-name",
        _vllm({"enableAutoToolChoice": True, "toolCallParser": "hermes; rm -rf"}),
        ("spec.vllm.toolCallParser", "should match"),
    ),
    (
        "vllm-reasoning-parser-too-long",
        _vllm({"reasoningParser": "r" * 65}),
        ("spec.vllm.reasoningParser", "Too long"),
    ),
    (
        "vllm-chat-template-relative",
        _vllm({"chatTemplate": "templates/chat.jinja"}),
        ("spec.vllm.chatTemplate", "should match"),
    ),
    (
        "vllm-no-flag-in-worker-args",
        _set("spec.worker.args", ["--no-vllm-enable-prefix-caching"]),
        ("spec.worker.args", "--vllm-*"),
    ),
    (
        "vllm-unknown-engine-arg",
        _vllm({"swapSpace": 4}),
        ('unknown field "spec.vllm.swapSpace"',),
    ),
    (
        "vllm-flag-in-worker-args",
        _set("spec.worker.args", ["--vllm-max-model-len=9"]),
        ("spec.worker.args", "--vllm-*"),
    ),
    # Issue 19: every flag that could bypass the gate, exact or abbreviated (argparse would take
    # "--gpu 1" for "--gpus 1"), with or without "=value", and the variables that choose the
    # worker's devices or its memory probe.
    *[
        (
            f"gate-flag-{i}",
            _set("spec.worker.args", ["--sequential", *args]),
            ("spec.worker.args", "must not set, or abbreviate", "--gpus", "--residual-slack"),
        )
        for i, args in enumerate(
            [
                ["--gpus", "1"],
                ["--gpu", "1"],
                ["--gpus=2"],
                ["--g=2"],
                ["--residual-slack=1Ti"],
                ["--resid", "1Ti"],
                ["--initial-state=active"],
                ["--init=active"],
                ["--epoch=0"],
                ["--rank", "1"],
                ["--vllm-gpu-memory-utilization=0.9"],
                ["--vl=1"],
                ["--", "--gpus", "1"],
            ]
        )
    ],
    *[
        (
            f"gate-env-{name.lower().replace('_', '-')}",
            _set("spec.template.env", [{"name": "HF_HOME", "value": "/x"}, {"name": name}]),
            ("spec.template.env[1].name", "must not set a variable the operator sets"),
        )
        for name in (
            "CUDA_VISIBLE_DEVICES",
            "OMNISTAGE_GPUS",
            "OMNISTAGE_MEMORY_PROBE",
            "OMNISTAGE_DRAIN_TIMEOUT",
            "OMNISTAGE_RANK",
        )
    ],
    (
        "duplicate-volume",
        _set("spec.template.volumes", [{"name": "a", "emptyDir": {}}, {"name": "a"}]),
        ("spec.template.volumes[1]", "Duplicate value"),
    ),
]


@pytest.mark.parametrize(("case", "mutate", "needles"), BAD, ids=[b[0] for b in BAD])
def test_bad_manifest_is_refused_naming_the_field(
    cluster: ControlPlane, namespace: str, case: str, mutate: Mutation, needles: tuple[str, ...]
) -> None:
    manifest = good(f"bad-{case}")
    mutate(manifest)
    proc = apply(cluster, namespace, manifest, check=False)
    assert proc.returncode != 0, f"{case}: accepted, but should be refused:\n{proc.stdout}"
    for needle in needles:
        assert needle in proc.stderr, f"{case}: {needle!r} not in refusal:\n{proc.stderr}"
    name = manifest["metadata"]["name"]
    gone = cluster.kubectl("get", "omnistage", name, "-n", namespace, check=False)
    assert gone.returncode != 0 and "NotFound" in gone.stderr


def test_worker_flags_that_leave_the_gate_alone_are_accepted(
    cluster: ControlPlane, namespace: str
) -> None:
    """The reserved-flag rule refuses by prefix, not everything: the user's own worker flags
    (and values that merely look like flags) still pass."""
    manifest = good("user-flags")
    args = ["--sequential", "--served-model-name=m", "--cpu-threads", "2", "--log-level=debug",
            "--max-held", "8", "--components=unet,vae", "--variant=fp16", "-v"]  # fmt: skip
    manifest["spec"]["worker"] = {"args": args}
    manifest["spec"]["template"] = {"env": [{"name": "OMNISTAGE_CPU_THREADS", "value": "2"}]}
    apply(cluster, namespace, manifest)
    assert get(cluster, namespace, "user-flags")["spec"]["worker"]["args"] == args


def test_defaults_are_applied(cluster: ControlPlane, namespace: str) -> None:
    apply(cluster, namespace, good("minimal"))
    spec = get(cluster, namespace, "minimal")["spec"]
    assert spec["state"] == "Active"
    assert spec["sleepLevel"] == 1
    assert spec["gpus"] == 1
    assert spec["colocation"] == {"group": "g1", "priority": 0}
    assert spec["model"] == {"path": "/models/tiny-llama", "mountPath": "/models"}
    assert spec["placement"] == {"mode": "DRA"}
    assert spec["worker"] == {"port": 50051, "httpPort": 8000, "metricsPort": 9464}
    assert spec["activation"] == {"policy": "Manual"}


def test_an_on_demand_stage_is_accepted_and_parses_back(
    cluster: ControlPlane, namespace: str
) -> None:
    manifest = good("lazy")
    manifest["spec"]["state"] = "Asleep"
    manifest["spec"]["activation"] = {
        "policy": "OnDemand",
        "idleAfter": "1m30s",
        "minResidency": "500ms",
        "holdTimeout": "20s",
    }
    apply(cluster, namespace, manifest)
    stage = parse_stage(get(cluster, namespace, "lazy"))
    assert stage.activation.on_demand
    assert (stage.activation.idle_after_s, stage.activation.min_residency_s) == (90.0, 0.5)
    assert stage.activation.hold_timeout_s == 20.0


def test_group_is_immutable_but_state_is_not(cluster: ControlPlane, namespace: str) -> None:
    apply(cluster, namespace, good("mover"))
    moved = good("mover")
    moved["spec"]["colocation"]["group"] = "g2"
    proc = apply(cluster, namespace, moved, check=False)
    assert proc.returncode != 0
    assert "spec.colocation.group" in proc.stderr and "immutable" in proc.stderr
    assert get(cluster, namespace, "mover")["spec"]["colocation"]["group"] == "g1"
    cluster.kubectl(
        "patch", "ost", "mover", "-n", namespace, "--type=merge",
        "-p", json.dumps({"spec": {"state": "Asleep", "colocation": {"priority": 7}}}),
    )  # fmt: skip
    spec = get(cluster, namespace, "mover")["spec"]
    assert (spec["state"], spec["colocation"]["priority"]) == ("Asleep", 7)


def test_int_vram_request_is_accepted(cluster: ControlPlane, namespace: str) -> None:
    manifest = good("int-vram")
    manifest["spec"]["vram"] = {"request": 17179869184}
    apply(cluster, namespace, manifest)
    stored = get(cluster, namespace, "int-vram")
    assert parse_stage(stored).vram_request_bytes == 16 * 1024**3


def test_vllm_engine_args_are_accepted_and_reach_the_worker(
    cluster: ControlPlane, namespace: str
) -> None:
    manifest = good("llm")
    _vllm({"maxModelLen": 2048, "gpuMemoryUtilization": 0.3, "maxNumSeqs": 128,
           "kvCacheDtype": "fp8", "enablePrefixCaching": False, "enableChunkedPrefill": True,
           "tensorParallelSize": 2})(manifest)  # fmt: skip
    manifest["spec"]["gpus"] = 2
    apply(cluster, namespace, manifest)
    stored = get(cluster, namespace, "llm")
    assert stored["spec"]["vllm"]["enforceEager"] is False  # defaulted
    stage = parse_stage(stored)
    pod = build_worker_pod(stage, initial_state=DesiredState.ASLEEP, owner=owner_reference(stored))
    args = pod["spec"]["containers"][0]["args"]
    assert args[args.index("--initial-state") + 1] == "active"  # vLLM starts once admitted
    assert args[args.index("--vllm-tensor-parallel-size") + 1] == "2"
    assert args[args.index("--vllm-gpu-memory-utilization") + 1] == "0.3"
    assert args[args.index("--vllm-max-num-seqs") + 1] == "128"
    assert args[args.index("--vllm-kv-cache-dtype") + 1] == "fp8"
    assert "--no-vllm-enable-prefix-caching" in args and "--vllm-enable-chunked-prefill" in args


def test_vllm_chat_options_are_accepted_and_reach_the_worker(
    cluster: ControlPlane, namespace: str
) -> None:
    manifest = good("chat")
    chat = {"enableAutoToolChoice": True, "toolCallParser": "llama3_json",
            "reasoningParser": "deepseek_r1", "chatTemplate": "/templates/chat.jinja"}  # fmt: skip
    _vllm(chat)(manifest)
    apply(cluster, namespace, manifest)
    stage = parse_stage(get(cluster, namespace, "chat"))
    args = vllm_args(stage)
    assert "--vllm-enable-auto-tool-choice" in args
    assert args[args.index("--vllm-tool-call-parser") + 1] == "llama3_json"
    assert args[args.index("--vllm-reasoning-parser") + 1] == "deepseek_r1"
    assert args[args.index("--vllm-chat-template") + 1] == "/templates/chat.jinja"


def _example_docs() -> list[dict[str, Any]]:
    return [doc for _, doc in stage_docs()]


def _apply_examples(cp: ControlPlane, namespace: str) -> None:
    """Every example OmniStage (the other kinds: tests/e2e/test_examples.py)."""
    for doc in _example_docs():
        apply(cp, namespace, doc)


def test_examples_are_accepted_and_parse_back(cluster: ControlPlane, namespace: str) -> None:
    docs = _example_docs()
    assert len(docs) >= 4
    _apply_examples(cluster, namespace)
    for doc in docs:
        stored = get(cluster, namespace, doc["metadata"]["name"])
        assert stored["metadata"]["generation"] == 1
        want = parse_stage({**doc, "metadata": {**doc["metadata"], "namespace": namespace}})
        got = parse_stage(stored)
        assert (got.runner, got.backend, got.model, got.state, got.sleep_level) == (
            want.runner,
            want.backend,
            want.model,
            want.state,
            want.sleep_level,
        )
        assert (got.colocation, got.gpus, got.vram_request_bytes, got.worker) == (
            want.colocation,
            want.gpus,
            want.vram_request_bytes,
            want.worker,
        )
        assert got.template.env == want.template.env
        assert got.template.tolerations == want.template.tolerations


def _status(state: str, used: str, freed: str) -> dict[str, Any]:
    return {
        "status": {
            "observedGeneration": 1,
            "state": state,
            "sleepLevel": 1,
            "node": "node-1",
            "pod": "p-worker",
            "memory": {"usedBytes": 3435973836, "used": used, "source": "accounting"},
            "lastAck": {
                "taskId": "t-1",
                "op": "sleep",
                "ok": True,
                "level": 1,
                "freedBytes": 1,
                "freed": freed,
                "time": "2026-11-21T05:00:00Z",
                "workers": ["p-worker"],
            },
            "waitingFor": [],
            # the operator's own helper makes the conditions, so their shape is checked here
            "conditions": set_condition(
                set_condition([], READY, True, Reason.WORKER_READY, "serving", 1, NOW),
                MEMORY_RELEASED,
                False,
                Reason.RESIDUAL_MEMORY,
                "still holds " + format_bytes(3435973836),
                1,
                NOW,
            ),
        }
    }


def patch_status(
    cp: ControlPlane, namespace: str, name: str, body: dict[str, Any], check: bool = True
) -> subprocess.CompletedProcess[str]:
    return cp.kubectl(
        "patch", "omnistage", name, "-n", namespace, "--subresource=status", "--type=merge",
        "-p", json.dumps(body), check=check,
    )  # fmt: skip


def test_printer_columns_and_status(cluster: ControlPlane, namespace: str) -> None:
    for name in ("alpha", "beta"):
        apply(cluster, namespace, good(name))
    patch_status(cluster, namespace, "alpha", _status("Active", "3.2Gi", "-3.2Gi"))
    patch_status(cluster, namespace, "beta", _status("Asleep", "0", "3.1Gi"))
    waiting = {
        "waitReason": "InsufficientMemory",
        "waitingFor": ["other tenants: 71Gi on GPU-1 (free 7.7Gi, needed 17Gi)"],
    }
    patch_status(cluster, namespace, "beta", {"status": waiting})  # fmt: skip

    out = cluster.kubectl("get", "omnistages", "-n", namespace).stdout
    lines = [line.split() for line in out.strip().splitlines()]
    header = ["NAME", "STATE", "LEVEL", "GROUP", "USED", "FREED", "NODE", "WAITING", "AGE"]
    assert lines[0] == header
    rows = {row[0]: row for row in lines[1:]}
    assert rows["alpha"][1:7] == ["Active", "1", "g1", "3.2Gi", "-3.2Gi", "node-1"]
    assert rows["beta"][1:8] == ["Asleep", "1", "g1", "0", "3.1Gi", "node-1", "InsufficientMemory"]

    short = cluster.kubectl("get", "ost", "-n", namespace, "-o", "name").stdout.split()
    assert sorted(short) == ["omnistage.omnistage.io/alpha", "omnistage.omnistage.io/beta"]
    category = cluster.kubectl("api-resources", "--categories=omnistage", "-o", "name").stdout
    assert category.split() == ["omnistages.omnistage.io"]

    wide = cluster.kubectl("get", "ost", "-n", namespace, "-o", "wide").stdout.splitlines()[0]
    assert wide.split()[-5:] == ["DESIRED", "PRIORITY", "WAITING", "WAITING-FOR", "AGE"]

    selected = cluster.kubectl(
        "get", "ost", "-n", namespace, "--field-selector", "spec.colocation.group=g1", "-o", "name"
    ).stdout.split()
    assert len(selected) == 2
    none = cluster.kubectl(
        "get", "ost", "-n", namespace, "--field-selector", "spec.colocation.group=g2", "-o", "name"
    ).stdout.split()
    assert none == []

    # status is a subresource: a spec write does not touch it, and bad status is refused too
    stored = get(cluster, namespace, "alpha")
    assert stored["status"]["lastAck"]["workers"] == ["p-worker"]
    assert [c["type"] for c in stored["status"]["conditions"]] == ["Ready", "MemoryReleased"]
    assert stored["status"]["conditions"][1]["message"] == "still holds 3.2Gi"
    bad = patch_status(cluster, namespace, "alpha", {"status": {"state": "Bogus"}}, check=False)
    assert bad.returncode != 0 and "status.state" in bad.stderr
    dup = copy.deepcopy(_status("Active", "1", "1"))
    dup["status"]["conditions"].append(dict(dup["status"]["conditions"][0]))
    refused = patch_status(cluster, namespace, "alpha", dup, check=False)
    assert refused.returncode != 0 and "status.conditions" in refused.stderr


# --- the children the builders make are valid objects for this API server -----------------


def _dry_run(cp: ControlPlane, namespace: str, obj: dict[str, Any]) -> dict[str, Any]:
    out = cp.kubectl(
        "create", "--dry-run=server", "--validate=strict", "-n", namespace, "-o", "json",
        "-f", "-", input=json.dumps(obj),
    ).stdout  # fmt: skip
    data: dict[str, Any] = json.loads(out)
    return data


def test_built_children_are_accepted_by_the_api_server(
    cluster: ControlPlane, namespace: str
) -> None:
    explicit = good("pinned")
    explicit["spec"]["placement"] = {"mode": "Explicit", "nodeName": "gpu-node-0", "devices": ["0"]}
    explicit["spec"]["template"] = {
        "env": [{"name": "HF_HOME", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}}],
        "volumes": [{"name": "cache", "emptyDir": {"sizeLimit": "1Gi"}}],
        "volumeMounts": [{"name": "cache", "mountPath": "/cache"}],
        "resources": {
            "requests": {"cpu": "500m", "memory": "1Gi"},
            "limits": {"memory": 2147483648},
        },
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "nodeSelector": {"kubernetes.io/os": "linux"},
        "priorityClassName": "system-node-critical",
    }
    _apply_examples(cluster, namespace)
    apply(cluster, namespace, explicit)
    names = [d["metadata"]["name"] for d in _example_docs()] + ["pinned"]
    groups: dict[str, int] = {}
    for name in names:
        stored = get(cluster, namespace, name)
        stage = parse_stage(stored)
        owner = owner_reference(stored)
        for state in (DesiredState.ACTIVE, DesiredState.ASLEEP):
            pod = _dry_run(
                cluster, namespace, build_worker_pod(stage, initial_state=state, owner=owner)
            )
            (c,) = pod["spec"]["containers"]
            assert c["readinessProbe"]["grpc"]["service"] == "omnistage.worker.v1.SleepService"
            assert pod["metadata"]["ownerReferences"][0]["uid"] == stored["metadata"]["uid"]
            assert ("resourceClaims" in pod["spec"]) == (name != "pinned")
        svc = _dry_run(cluster, namespace, build_service(stage, owner=owner))
        assert svc["spec"]["ports"][0]["name"] == "grpc"
        if stage.placement.mode is PlacementMode.DRA:
            groups[stage.group] = max(groups.get(stage.group, 0), stage.gpus)
    for group, gpus in groups.items():
        claim = _dry_run(cluster, namespace, build_group_claim(namespace, group, gpus))
        request = claim["spec"]["devices"]["requests"][0]
        assert request["exactly"]["count"] == gpus
        assert request["exactly"]["deviceClassName"] == "gpu.nvidia.com"
    secret = _dry_run(cluster, namespace, build_token_secret(namespace, "not-a-real-token"))
    assert secret["metadata"]["name"] == "omnistage-worker-token"
