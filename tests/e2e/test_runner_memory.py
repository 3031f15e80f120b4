"""The operator's memory follows the stages that exist (issue 24): once every stage of a few
groups is deleted, nothing the runner kept for them is left (its per-stage and per-group
entries, worker channels, demand streams: ``omnistage_runner_entries``), nor their Prometheus
series; a group re-created under the same name runs again from nothing.

Real API server and operator; the workers are the simulated worker host's (localnode
``--sim-hosts``: real gRPC SleepService and DemandService, ACKs over the simulated GPU, no
model), two OnDemand stages per group as bench/scale.py builds them, one woken before the
delete. Before the fix, a deleted group's loop, kept readings, sleep tracker and rounds' series
stayed for the life of the process, and each deleted OnDemand pod took its whole grace period.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.scale_storms import stage
from tests.cluster.localnode import LocalNodes
from tests.e2e.conftest import Cluster, OperatorProcess, wait_for

pytestmark = [pytest.mark.timeout(300)]

GROUPS = 3
SCOPES = ("stage", "group", "channel", "demand")
SIM = {"OMNISTAGE_SIM_WEIGHTS": str(1 << 30), "OMNISTAGE_SIM_TRANSFER_S": "0"}


def _manifests(group: str, node: str, model_dir: Path) -> list[dict[str, Any]]:
    return [
        stage(f"{group}-{s}", group, node, model_dir=str(model_dir), state="Asleep", env=SIM)
        for s in ("a", "b")
    ]


def _states(cluster: Cluster) -> dict[str, str | None]:
    items = cluster.cp.get_json("omnistages", namespace=cluster.namespace)["items"]
    return {i["metadata"]["name"]: (i.get("status") or {}).get("state") for i in items}


# Series of the namespace itself, not of its groups: the operator serves the namespace named in
# its --namespace list (and holds its claim) whether or not groups live there.
NAMESPACE_SERIES = frozenset({"omnistage_namespace_claim_held"})


def _scrape(op: OperatorProcess, namespace: str) -> tuple[dict[str, float], set[str]]:
    """The runner's entries by scope, and the metrics with a series of ``namespace`` (its
    groups' and stages': ``NAMESPACE_SERIES`` left out)."""
    entries: dict[str, float] = {}
    labelled: set[str] = set()
    for family in text_string_to_metric_families(op.metrics()):
        for sample in family.samples:
            if family.name == "omnistage_runner_entries":
                entries[sample.labels["scope"]] = sample.value
            elif sample.labels.get("namespace") == namespace:
                labelled.add(family.name)
    return entries, labelled - NAMESPACE_SERIES


def test_deleted_groups_leave_nothing_in_the_operator(
    cluster: Cluster,
    operator: OperatorProcess,
    make_local_nodes: Any,
    tmp_path: Path,
) -> None:
    nodes: LocalNodes = make_local_nodes(nodes=1, gpus=GROUPS, sim_hosts=1)
    node = nodes.node_names[0]
    groups = [f"g{i}" for i in range(GROUPS)]
    ns = cluster.namespace
    cluster.cp.apply([m for g in groups for m in _manifests(g, node, tmp_path)], namespace=ns)
    names = [f"{g}-{s}" for g in groups for s in ("a", "b")]
    wait_for("every stage Asleep", lambda: _states(cluster) == dict.fromkeys(names, "Asleep"), 120)
    for g in groups:
        cluster.patch_state(f"{g}-a", "Active")
    wait_for(
        "every group's a Active",
        lambda: all(_states(cluster)[f"{g}-a"] == "Active" for g in groups),
        60,
    )
    entries, labelled = _scrape(operator, ns)
    assert {"omnistage_rounds", "omnistage_stage_state"} <= labelled, labelled
    assert entries.get("group", 0) >= GROUPS and entries.get("stage", 0) >= len(names), entries
    assert entries.get("channel", 0) >= GROUPS, entries  # at least the Active stages' workers

    cluster.cp.kubectl("delete", "omnistages", "--all", "-n", ns, "--wait=false")
    # within less than the pods' 30 s grace: the operator closed its demand streams to them
    # first (a worker's gRPC server waited for that open call: each pod took its whole grace)
    wait_for("the stages gone", lambda: not _states(cluster), 25)

    def forgotten() -> bool:
        entries, labelled = _scrape(operator, ns)
        return all(entries.get(s) == 0 for s in SCOPES) and not labelled

    try:
        wait_for("the groups forgotten", forgotten, 60)
    finally:
        print(_scrape(operator, ns))

    # The same group again: a fresh loop, its rounds and series as for a new group.
    cluster.cp.apply(_manifests(groups[0], node, tmp_path), namespace=ns)
    wait_for(
        "the re-created group Asleep",
        lambda: _states(cluster) == dict.fromkeys(names[:2], "Asleep"),
        60,
    )
    entries, labelled = _scrape(operator, ns)
    assert entries.get("group", 0) >= 1 and "omnistage_rounds" in labelled, (entries, labelled)
