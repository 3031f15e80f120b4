"""A round's Kubernetes API traffic does not grow with the namespace.

A group's round reads its stages and worker pods from the operator's watches (kopf indexes),
so what it asks the API server (a claim, a status patch when something changed) is the same
for a group alone in its namespace as for one of 25 groups. Measured by the operator itself
(``omnistage_round_api_requests_total``: every API call a round makes; ``..._objects_total``:
the objects its reads returned, GET one, LIST its items), on the real operator and API server.
Before the indexes, a round of the same group read 5.4 objects alone and 101.8 among 25 groups
(two LISTs of the namespace). The stages' pods are never scheduled (no
node matches), so every round is the same steady round of pods that are starting.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from omnistage_operator.api.labels import MANAGED_BY_LABEL, MANAGER, selector_string
from tests.e2e.conftest import Cluster, OperatorProcess, stage_manifest, wait_for

pytestmark = [pytest.mark.timeout(600)]

GROUPS = 25
STAGES_PER_GROUP = 2
ROUNDS = 8  # rounds of the measured group per measurement


def _counters(op: OperatorProcess, namespace: str, group: str) -> dict[str, float]:
    """The measured group's rounds, API requests and objects read, from /metrics."""
    wanted = {
        "omnistage_rounds": "rounds",
        "omnistage_round_api_requests": "requests",
        "omnistage_round_api_objects": "objects",
    }
    out = dict.fromkeys(wanted.values(), 0.0)
    for family in text_string_to_metric_families(op.metrics()):
        key = wanted.get(family.name)
        if key is None:
            continue
        for sample in family.samples:
            labels = sample.labels
            if (
                sample.name.endswith("_total")
                and labels.get("namespace") == namespace
                and labels.get("group") == group
            ):
                out[key] += sample.value
    return out


def _per_round(op: OperatorProcess, namespace: str, group: str) -> tuple[float, float]:
    """(requests, objects) per round of ``group``, over at least ``ROUNDS`` rounds."""
    before = _counters(op, namespace, group)

    def enough() -> dict[str, float] | None:
        now = _counters(op, namespace, group)
        return now if now["rounds"] >= before["rounds"] + ROUNDS else None

    after = wait_for(f"{ROUNDS} rounds of {group}", enough, 120)
    rounds = after["rounds"] - before["rounds"]
    return (
        (after["requests"] - before["requests"]) / rounds,
        (after["objects"] - before["objects"]) / rounds,
    )


def _manifests(group: str, names: list[str], model: Path) -> list[dict[str, Any]]:
    # Asleep stages on a node that does not exist: their pods stay Pending (no worker runs),
    # so the group's rounds keep polling its starting pods.
    return [
        stage_manifest(n, "ar", {"ar": model}, "no-such-node", group=group, state="Asleep")
        for n in names
    ]


def _pods(cluster: Cluster) -> int:
    selector = selector_string({MANAGED_BY_LABEL: MANAGER})
    data = cluster.cp.get_json("pods", "-l", selector, namespace=cluster.namespace)
    return len(data.get("items", []))


def test_round_traffic_does_not_grow_with_the_namespace(
    cluster: Cluster, operator: OperatorProcess, tmp_path: Path
) -> None:
    ns = cluster.namespace
    measured = "g0"
    cluster.cp.apply(_manifests(measured, ["s0-0", "s0-1"], tmp_path), namespace=ns)
    wait_for("the measured group's pods", lambda: _pods(cluster) == STAGES_PER_GROUP, 60)
    wait_for(
        "the measured group's status",
        lambda: all(cluster.state(n) == "Pending" for n in ("s0-0", "s0-1")),
        60,
    )
    alone = _per_round(operator, ns, measured)

    others = [
        m
        for g in range(1, GROUPS)
        for m in _manifests(f"g{g}", [f"s{g}-{i}" for i in range(STAGES_PER_GROUP)], tmp_path)
    ]
    cluster.cp.apply(others, namespace=ns)
    wait_for("every stage's pod", lambda: _pods(cluster) == GROUPS * STAGES_PER_GROUP, 180)
    crowded = _per_round(operator, ns, measured)

    print(f"per round of {measured}: alone {alone}, among {GROUPS} groups {crowded}")
    requests_alone, objects_alone = alone
    requests_crowded, objects_crowded = crowded
    # What one round reads is its own group's: the same, whatever else the namespace holds.
    assert objects_crowded <= objects_alone + 0.5, (alone, crowded)
    # Writes (status, Events) follow what changed, not the namespace: a little slack for a
    # status rewritten when a loaded machine renews its Lease late.
    assert requests_crowded <= requests_alone + 1.0, (alone, crowded)
    # ... and no list of the namespace: at most a few objects of its own per round.
    assert objects_crowded <= 2 * STAGES_PER_GROUP, crowded
