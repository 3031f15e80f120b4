"""Two shards whose namespace lists overlap, on the real API server with simulated workers: the
namespace's claim keeps the memory promise (one shard orders its workers).

Shard x serves namespace x; shard y serves y and, by a pattern, x. x's claim (Lease
``omnistage-namespace-claim`` in x) is shard x's, so shard y's rounds in x wait, naming shard x
(``status.namespaceClaim``, a ``NamespaceClaimed`` Event,
``omnistage_namespace_claimed_by_other_shard``), while shard x hands over there and shard y hands
over in y. Once shard x is stopped (it releases its claim), shard y takes the claim and hands over
in x. Once x's stages are deleted, shard y (which claimed x because its rounds asked, not by
name) drops x's claim a lease duration later.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from bench.scale_operators import NamedOperator
from bench.scale_storms import stage
from tests.cluster.controlplane import ControlPlane
from tests.cluster.localnode import LocalNodes
from tests.e2e.conftest import Cluster, wait_for

pytestmark = [pytest.mark.timeout(300)]

GiB = 1024**3
ENV = {"OMNISTAGE_SIM_WEIGHTS": str(50 * GiB), "OMNISTAGE_SIM_TRANSFER_S": "0.05"}
ASLEEP = ("Asleep", "Waiting")
CLAIM = "omnistage-namespace-claim"


def _outcomes(op: NamedOperator, namespace: str) -> dict[str, float]:
    """This operator's rounds in ``namespace`` by outcome (``omnistage_rounds_total``)."""
    found: dict[str, float] = {}
    pattern = r"^omnistage_rounds_total\{([^}]*)\} ([0-9.e+]+)$"
    for labels, value in re.findall(pattern, op.metrics(), re.M):
        if f'namespace="{namespace}"' in labels:
            outcome = re.search(r'outcome="([^"]+)"', labels)
            assert outcome is not None
            found[outcome[1]] = found.get(outcome[1], 0.0) + float(value)
    return found


def _claim_holder(c: Cluster) -> str:
    res = c.cp.kubectl("get", "lease", CLAIM, "-n", c.namespace, "-o",
                       "jsonpath={.spec.holderIdentity}", check=False)  # fmt: skip
    return res.stdout if res.returncode == 0 else ""


def _settled(c: Cluster, active: str, asleep: str) -> bool:
    return c.state(f"g0-{active}") == "Active" and c.state(f"g0-{asleep}") in ASLEEP


def _both_asleep(c: Cluster) -> bool:
    return c.state("g0-a") == c.state("g0-b") == "Asleep"


def _wait_written(c: Cluster, name: str) -> dict[str, Any] | None:
    return c.status(name).get("namespaceClaim") or None


def _cleared(c: Cluster, name: str) -> bool:
    return _wait_written(c, name) is None


@pytest.fixture
def overlap(
    omnistage_crd: ControlPlane, make_local_nodes: Callable[..., LocalNodes], tmp_path: Path
) -> Iterator[tuple[Cluster, Cluster, NamedOperator, NamedOperator, Path, str]]:
    cp = omnistage_crd
    nodes = make_local_nodes(nodes=1, gpus=8, name_prefix="claim-", sim_hosts=1)
    model = tmp_path / "model"
    model.mkdir()
    x, y = (Cluster(cp, cp.create_namespace(f"claim-{k}")) for k in "xy")
    op_x = NamedOperator(cp, x.namespace, tmp_path / "opx", "shard-x-op")
    op_y = NamedOperator(cp, y.namespace, tmp_path / "opy", "shard-y-op")
    op_y.extra += ["--namespace", x.namespace[:-1] + "?"]  # a pattern: overlaps shard x's list
    try:
        yield x, y, op_x, op_y, model, nodes.node_names[0]
    finally:
        for op in (op_x, op_y):
            op.stop()
            print(f"--- {op.name} log tail ---\n{op.tail(40)}")
        for c in (x, y):
            cp.delete_namespace(c.namespace)


def test_overlapping_shards_order_a_namespace_one_at_a_time(
    overlap: tuple[Cluster, Cluster, NamedOperator, NamedOperator, Path, str],
) -> None:
    x, y, op_x, op_y, model, node = overlap
    shard_x, shard_y = f"{x.namespace}/omnistage-operator", f"{y.namespace}/omnistage-operator"
    op_x.start()
    wait_for("shard x claims x", lambda: _claim_holder(x).startswith(shard_x + "#"), 60)
    op_y.start()
    for c in (x, y):
        for s in "ab":
            c.apply(stage(f"g0-{s}", "g0", node, model_dir=str(model), state="Asleep", env=ENV))
    for c in (x, y):
        wait_for(f"{c.namespace}: both stages asleep", partial(_both_asleep, c), 120)
        c.patch_state("g0-a", "Active")
    for c in (x, y):
        wait_for(f"{c.namespace}: g0-a Active", partial(_settled, c, "a", "b"), 60)
    wait_for("shard y claims y", lambda: _claim_holder(y).startswith(shard_y + "#"), 30)

    # shard y's rounds in x wait, naming shard x: in status, an Event, a metric, its log
    for name in ("g0-a", "g0-b"):
        wait = wait_for(f"{name}: shard y's wait in status", partial(_wait_written, x, name), 60)
        assert wait["reason"] == "NamespaceClaimed", wait
        assert wait["shard"] == shard_y and wait["claimedBy"] == shard_x, wait
        assert wait["holder"].startswith(shard_x + "#shard-x-op_"), wait
        assert f"claimed by shard {shard_x}" in wait["message"], wait
    events = x.reasons_include("g0-a", {"NamespaceClaimed"})
    assert any(shard_x in e["message"] for e in events if e["reason"] == "NamespaceClaimed")
    claimed_by = re.compile(
        r'^omnistage_namespace_claimed_by_other_shard\{holder="' + re.escape(shard_x)
        + r'#[^"]*",namespace="' + re.escape(x.namespace) + r'"\} 1\.0$', re.M,
    )  # fmt: skip
    assert claimed_by.search(op_y.metrics()), op_y.metrics()
    assert f"is claimed by shard {shard_x}" in op_y.tail(400)

    # a hand-over in each namespace: x by shard x alone, y by shard y
    for c in (x, y):
        c.patch_state("g0-a", "Asleep")
        c.patch_state("g0-b", "Active")
    for c in (x, y):
        wait_for(f"{c.namespace}: handed over to g0-b", partial(_settled, c, "b", "a"), 60)
    waits = _outcomes(op_y, x.namespace)  # never a round in x (pending: before its first read)
    assert "namespace_claimed" in waits and set(waits) <= {"namespace_claimed", "claim_pending"}
    assert "acted" in _outcomes(op_x, x.namespace)
    assert "acted" in _outcomes(op_y, y.namespace)
    assert f'namespace="{x.namespace}"' not in "\n".join(
        line for line in op_y.metrics().splitlines() if line.startswith("omnistage_transitions")
    )
    assert _claim_holder(x).startswith(shard_x + "#")
    first = x.worker_status("g0-b")  # the epoch shard x's orders carried: its own (claimed once)
    assert first is not None and 1 <= first.epoch < 2**32, first

    # shard x stops (SIGTERM: it clears its claim's holder on its way out): shard y takes x over
    op_x.stop()
    wait_for("shard y claims x", lambda: _claim_holder(x).startswith(shard_y + "#"), 60)
    x.patch_state("g0-b", "Asleep")
    x.patch_state("g0-a", "Active")
    wait_for("x handed back to g0-a by shard y", lambda: _settled(x, "a", "b"), 60)
    assert "acted" in _outcomes(op_y, x.namespace)
    # shard y's orders there rank above shard x's: the claim's second holder adds 2**32
    taken = x.worker_status("g0-a")
    assert taken is not None and taken.epoch >= 2**32 + 1, taken
    for name in ("g0-a", "g0-b"):  # shard y cleared the wait it wrote
        wait_for(f"{name}: wait cleared", partial(_cleared, x, name), 30)

    # x's stages go: shard y drops x's claim (cleared, as on shutdown) and its series
    x.cp.kubectl("delete", "omnistage", "g0-a", "g0-b", "-n", x.namespace, "--timeout=60s")
    held = f'omnistage_namespace_claim_held{{namespace="{x.namespace}"}}'
    assert held in op_y.metrics()
    wait_for("shard y drops x's claim", lambda: _claim_holder(x) == "", 60)
    assert held not in op_y.metrics()
    assert f"namespace {x.namespace} has no group left: its claim dropped" in op_y.tail(400)
