"""The real API server enforces the OmniStage schema: bad manifests are refused naming the field.

Runs against the local control plane (``control_plane`` and ``namespace`` fixtures from
tests/cluster/pytest_plugin.py). Each bad manifest is a small change to a good one, applied
with ``kubectl apply`` (``--validate=strict`` so unknown fields are errors too); the test
checks the refusal names the field and says why, and that nothing was stored. It also
server-side dry-runs the children the builders make (pod, Service, claim, Secret).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

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
from tests.cluster.controlplane import ControlPlane
from tests.e2e.crd_bad_manifests import BAD
from tests.e2e.crd_stage import Mutation, _vllm, apply, cluster, get, good
from tests.examples import stage_docs

__all__ = ["cluster"]  # the fixture: the control plane with the CRD established
pytestmark = pytest.mark.cluster


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
    assert args[args.index("--initial-state") + 1] == "asleep"  # pre-warmed, no engine yet
    assert args[args.index("--sleep-level") + 1] == "2"
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
