"""Operator end to end: priorities decide who holds the GPU; deletion removes every child."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e.conftest import ROOT, Cluster, OperatorProcess, stage_manifest, wait_for
from tests.e2e.holding_log import handed_over

pytestmark = [pytest.mark.timeout(600)]


def test_highest_priority_wish_gets_the_memory_and_hands_it_on(
    cluster: Cluster, operator: OperatorProcess, tiny_models: dict[str, Path], gpu_node: str
) -> None:
    # Three diffusion stages; each fits the fake GPU only alone.
    for name, prio in (("low", 0), ("mid", 5), ("high", 10)):
        cluster.apply(stage_manifest(name, "sd", tiny_models, gpu_node, priority=prio))
    wait_for("high Active", lambda: cluster.state("high") == "Active", 240)
    wait_for(
        "mid and low waiting for high",
        lambda: all(
            cluster.status(n).get("state") == "Waiting"
            and cluster.status(n).get("waitingFor") == ["high"]
            for n in ("mid", "low")
        ),
        120,
    )
    # Lowering its wish hands the memory to the next priority, never to the lowest.
    cluster.patch_state("high", "Asleep")
    wait_for("mid Active", lambda: cluster.state("mid") == "Active", 120)
    assert cluster.state("high") == "Asleep"
    assert cluster.status("low")["waitingFor"] == ["mid"]
    high, mid = cluster.worker_status("high"), cluster.worker_status("mid")
    assert high is not None and mid is not None
    assert high.last_ack is not None and mid.last_ack is not None
    assert high.last_ack.op == "sleep" and high.last_ack.ok
    assert handed_over("high", high.last_ack, "mid", mid.last_ack)
    conds = {c["type"]: c for c in cluster.status("low")["conditions"]}
    assert conds["Admitted"]["status"] == "False"
    assert conds["Admitted"]["reason"] == "LowerPriority"


def test_delete_removes_pod_service_and_last_claim(
    cluster: Cluster, operator: OperatorProcess, tiny_models: dict[str, Path], gpu_node: str
) -> None:
    cluster.apply(stage_manifest("ar", "ar", tiny_models, gpu_node, group="gdel"))
    cluster.apply(stage_manifest("sd", "sd", tiny_models, gpu_node, group="gdel", state="Asleep"))
    wait_for("ar Active", lambda: cluster.state("ar") == "Active", 180)
    wait_for("sd Asleep", lambda: cluster.state("sd") == "Asleep", 60)
    claim = "omnistage-gdel-gpus"
    assert cluster.exists("resourceclaim", claim)
    for stage in ("ar", "sd"):
        assert cluster.exists("pod", f"{stage}-worker")
        assert cluster.exists("service", f"{stage}-worker")
    assert cluster.exists("secret", "omnistage-worker-token")

    cluster.cp.kubectl("delete", "omnistage", "sd", "-n", cluster.namespace, "--wait=true")
    wait_for("sd pod gone", lambda: not cluster.exists("pod", "sd-worker"), 60)
    assert not cluster.exists("service", "sd-worker")
    assert cluster.exists("resourceclaim", claim), "claim deleted while ar still uses it"
    assert cluster.state("ar") == "Active"

    cluster.cp.kubectl("delete", "omnistage", "ar", "-n", cluster.namespace, "--wait=true")
    wait_for("ar pod gone", lambda: not cluster.exists("pod", "ar-worker"), 60)
    assert not cluster.exists("service", "ar-worker")
    wait_for("claim gone", lambda: not cluster.exists("resourceclaim", claim), 60)


def test_switch_as_the_charts_service_account(
    cluster: Cluster, tmp_path: Path, tiny_models: dict[str, Path], gpu_node: str
) -> None:
    """The operator needs no more than the chart's RBAC: run it as that ServiceAccount."""
    ns = cluster.namespace
    rendered = cluster.cp.helm(
        "template", ns, str(ROOT / "charts" / "omnistage-operator"), "--namespace", ns
    ).stdout
    rbac_kinds = {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}
    docs: list[dict[str, Any]] = [
        d for d in yaml.safe_load_all(rendered) if d and d.get("kind") in rbac_kinds
    ]
    assert any(d["kind"] == "ClusterRole" for d in docs)
    cluster.cp.apply(docs)
    account = next(d["metadata"]["name"] for d in docs if d["kind"] == "ServiceAccount")
    kubeconfig = cluster.cp.service_account_kubeconfig(ns, account)
    op = OperatorProcess(cluster.cp, ns, tmp_path, kubeconfig=kubeconfig)
    op.extra = [f"--lease-name={account}"]  # as the chart's pod: its Lease grant names it
    op.start()
    try:
        cluster.apply(stage_manifest("ar", "ar", tiny_models, gpu_node, group="grbac"))
        cluster.apply(
            stage_manifest("sd", "sd", tiny_models, gpu_node, group="grbac", state="Asleep")
        )
        wait_for("ar Active", lambda: cluster.state("ar") == "Active", 180)
        wait_for("sd Asleep", lambda: cluster.state("sd") == "Asleep", 60)
        cluster.patch_state("sd", "Active")
        wait_for("sd Active", lambda: cluster.state("sd") == "Active", 120)
        cluster.reasons_include("ar", {"Slept", "Waiting"})
        log = op.log.read_text(errors="replace")
        assert "Forbidden" not in log and "HTTP 403" not in log, op.tail(40)
        assert "leadership acquired" in log
    finally:
        op.stop()
        for d in docs:
            if d["kind"].startswith("Cluster"):
                cluster.cp.kubectl("delete", d["kind"], d["metadata"]["name"], check=False)
