"""The real API server takes an OmniStage's status and shows its printer columns."""

from __future__ import annotations

import copy
import json
import subprocess
from datetime import UTC, datetime
from typing import Any

import pytest

from omnistage_operator.api.conditions import MEMORY_RELEASED, READY, Reason, set_condition
from omnistage_worker.quantities import format_bytes
from tests.cluster.controlplane import ControlPlane
from tests.e2e.crd_stage import apply, cluster, get, good

__all__ = ["cluster"]  # the fixture: the control plane with the CRD established
pytestmark = pytest.mark.cluster


NOW = datetime(2026, 11, 21, 5, 0, tzinfo=UTC)


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
