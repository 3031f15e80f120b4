"""Shards: two operator processes, each serving its own namespace with its own Lease, on the real
API server with simulated workers (tests/scale/simhost.py, as bench/scale.py's).

Each shard hands over its own group (both named ``g0``: a group belongs to its namespace), its
operator's rounds and Lease name only its namespace, and killing one shard's operator leaves the
other shard's hand-overs working while the dead shard's stages wait for their own operator.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

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


def _round_namespaces(op: NamedOperator) -> set[str]:
    """The namespaces this operator ran rounds in (``omnistage_rounds_total``)."""
    text = op.metrics()
    return set(re.findall(r'^omnistage_rounds_total\{[^}]*namespace="([^"]+)"', text, re.M))


def _settled(c: Cluster, active: str, asleep: str) -> bool:
    return c.state(f"g0-{active}") == "Active" and c.state(f"g0-{asleep}") in ASLEEP


def _hand_over(c: Cluster, gainer: str, loser: str) -> None:
    """Ask ``gainer`` Active and withdraw ``loser``'s ask (its spec Asleep)."""
    c.patch_state(f"g0-{loser}", "Asleep")
    c.patch_state(f"g0-{gainer}", "Active")


def _both_asleep(c: Cluster) -> bool:
    return c.state("g0-a") == c.state("g0-b") == "Asleep"


@pytest.fixture
def shards(
    omnistage_crd: ControlPlane, make_local_nodes: Callable[..., LocalNodes], tmp_path: Path
) -> Iterator[tuple[list[Cluster], list[NamedOperator]]]:
    cp = omnistage_crd
    nodes = make_local_nodes(nodes=1, gpus=8, name_prefix="shard-", sim_hosts=1)
    model = tmp_path / "model"
    model.mkdir()
    clusters = [Cluster(cp, cp.create_namespace(f"shard-{k}")) for k in "ab"]
    ops = [NamedOperator(cp, c.namespace, tmp_path / f"op{k}", f"shard-{k}-op")
           for k, c in zip("ab", clusters, strict=True)]  # fmt: skip
    try:
        for op in ops:
            op.start()
        for c in clusters:
            for s in "ab":
                c.apply(stage(f"g0-{s}", "g0", nodes.node_names[0], model_dir=str(model),
                              state="Asleep", env=ENV))  # fmt: skip
        yield clusters, ops
    finally:
        for op in ops:
            op.stop()
            print(f"--- {op.name} log tail ---\n{op.tail(30)}")
        for c in clusters:
            cp.delete_namespace(c.namespace)


def test_two_shards_each_hand_over_their_own_namespace_and_survive_the_other(
    shards: tuple[list[Cluster], list[NamedOperator]],
) -> None:
    (a, b), (op_a, op_b) = shards
    for c in (a, b):
        wait_for(f"{c.namespace}: both stages asleep", partial(_both_asleep, c), 120)
        c.patch_state("g0-a", "Active")
    for c in (a, b):
        wait_for(f"{c.namespace}: g0-a Active", partial(_settled, c, "a", "b"), 60)
    # a hand-over in each shard at once: b wakes, a sleeps
    for c in (a, b):
        _hand_over(c, "b", "a")
    for c in (a, b):
        wait_for(f"{c.namespace}: handed over to g0-b", partial(_settled, c, "b", "a"), 60)
    # each operator ran rounds in its own namespace only, and holds its own namespace's Lease
    assert _round_namespaces(op_a) == {a.namespace}
    assert _round_namespaces(op_b) == {b.namespace}
    for c, op in ((a, op_a), (b, op_b)):
        lease = c.cp.get_json("lease", "omnistage-operator", namespace=c.namespace)
        assert lease["spec"]["holderIdentity"].startswith(op.name + "_"), lease
    # shard a's operator dies; shard b hands over again, shard a's stages wait for theirs
    op_a.kill()
    for c in (a, b):
        _hand_over(c, "a", "b")
    wait_for("shard b handed back to g0-a", lambda: _settled(b, "a", "b"), 60)
    assert _round_namespaces(op_b) == {b.namespace}
    assert a.state("g0-a") in ASLEEP and a.state("g0-b") == "Active"
