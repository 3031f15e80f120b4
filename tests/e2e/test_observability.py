"""Metrics and JSON logs of the real operator (and of a worker pod it made) after a hand-over on
the local control plane."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.cluster.controlplane import ControlPlane
from tests.cluster.localnode.runtime import LOG_ANNOTATION
from tests.e2e.conftest import Cluster, Gpu, OperatorProcess, stage_manifest, wait_for

pytestmark = [pytest.mark.timeout(600)]

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum over every series of ``name`` whose labels include ``labels``."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= set(ls))


def _log_object(line: str) -> bool:
    """The line is one JSON log object."""
    try:
        obj = json.loads(line)
    except ValueError:
        return False
    return isinstance(obj, dict) and {"level", "logger", "message"} <= obj.keys()


@pytest.fixture
def json_operator(
    omnistage_crd: ControlPlane, namespace: str, tmp_path: Path
) -> Iterator[OperatorProcess]:
    op = OperatorProcess(omnistage_crd, namespace, tmp_path)
    op.extra = ["--log-format", "json"]
    op.start()
    yield op
    op.stop()
    print(f"--- operator log tail ---\n{op.tail()}")


def test_handover_metrics_and_json_logs(
    cluster: Cluster,
    json_operator: OperatorProcess,
    tiny_models: dict[str, Path],
    gpu: Gpu,
) -> None:
    op, ns = json_operator, cluster.namespace
    cluster.apply(stage_manifest("ar", "ar", tiny_models, gpu.node, state="Active"))
    cluster.apply(stage_manifest("sd", "sd", tiny_models, gpu.node, state="Asleep"))
    wait_for("ar Active", lambda: cluster.state("ar") == "Active", 180)
    wait_for("sd Asleep", lambda: cluster.state("sd") == "Asleep", 60)
    cluster.patch_state("sd", "Active")
    wait_for("sd Active", lambda: cluster.state("sd") == "Active", 120)
    wait_for("ar Waiting", lambda: cluster.state("ar") == "Waiting", 30)
    ar_status = cluster.status("ar")

    samples = parse(op.metrics())
    group = {"namespace": ns, "group": "g1"}
    # The hand-over: its duration, the ACK verdicts, the rounds and their API requests.
    assert total(samples, "omnistage_handover_seconds_count", **group) >= 1
    assert total(samples, "omnistage_ack_verdicts_total", **group, op="sleep", verdict="ok") >= 1
    assert total(samples, "omnistage_ack_verdicts_total", **group, op="wake", verdict="ok") >= 1
    assert total(samples, "omnistage_ack_verdicts_total", verdict="contradicted") == 0
    assert total(samples, "omnistage_rounds_total", **group, outcome="acted") >= 1
    assert total(samples, "omnistage_round_api_requests_total", **group) > 0
    assert value(samples, "omnistage_leader") == 1
    # What the start-up built is frozen out of garbage collection (k8s.gc_policy).
    assert (value(samples, "omnistage_gc_frozen_objects") or 0) > 10_000
    # Per stage: the state and wait reason the status shows, device memory per device.
    state = "omnistage_stage_state"
    assert value(samples, state, **group, stage="sd", state="Active") == 1
    assert value(samples, state, **group, stage="sd", state="Asleep") == 0
    assert value(samples, state, **group, stage="ar", state="Waiting") == 1
    reason = ar_status["waitReason"]
    waiting = {**group, "stage": "ar", "reason": reason}
    assert value(samples, "omnistage_stage_waiting", **waiting) == 1
    assert total(samples, "omnistage_waits_total", **group, reason=reason) >= 1
    sd_used = ar_status and cluster.status("sd")["devices"][0]
    assert total(samples, "omnistage_stage_device_used_bytes", stage="sd") > 0
    assert total(samples, "omnistage_device_total_bytes") >= sd_used["totalBytes"] > 0

    # The worker pod the operator made serves its own metrics on the "metrics" port.
    pod = cluster.pod("sd")
    assert pod is not None
    ports = {p["name"]: p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]}
    url = f"http://{pod['status']['podIP']}:{ports['metrics']}/metrics"
    with urllib.request.urlopen(url, timeout=10) as resp:
        worker = parse(resp.read().decode())
    assert value(worker, "omnistage_worker_state", state="ACTIVE") == 1
    woken = "omnistage_worker_transitions_total"
    assert value(worker, woken, operation="wake_up", result="ok") == 1

    # The worker logs as the operator does: JSON lines, one object each (the pod got the
    # operator's format; nothing in the stage's spec asked for it).
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env.get("OMNISTAGE_LOG_FORMAT") == "json"
    worker_log = Path(pod["metadata"]["annotations"][f"{LOG_ANNOTATION}worker"])
    worker_lines = [  # (localnode, the kubelet's stand-in, marks each container start)
        line
        for line in worker_log.read_text().splitlines()
        if line.strip() and not line.startswith("--- localnode:")
    ]
    assert worker_lines
    others = [line for line in worker_lines if not _log_object(line)]
    assert not others, "\n".join(others)

    # A deleted stage's series go (not left at their last value).
    cluster.cp.kubectl("delete", "omnistage", "ar", "-n", ns, "--wait=false")

    def ar_gone() -> bool:
        return total(parse(op.metrics()), state, stage="ar") == 0 and not any(
            n == state and ("stage", "ar") in ls for n, ls in parse(op.metrics())
        )

    wait_for("ar's series removed", ar_gone, 60)

    # JSON logs: every line one object; the hand-over line carries its structured fields.
    lines = [json.loads(line) for line in op.log.read_text().splitlines() if line.strip()]
    for line in lines:
        assert {"time", "level", "logger", "message"} <= line.keys(), line
    handovers = [line for line in lines if "handover_id" in line]
    assert handovers, "no hand-over line"
    h = handovers[-1]
    assert (h["namespace"], h["group"], h["slept"], h["woke"]) == (ns, "g1", ["ar"], ["sd"])
    assert h["task_ids"] and h["epoch"] >= 1
