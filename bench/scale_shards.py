"""Shards for bench/scale.py: N namespaces, each served by its own operator(s) and Lease.

Shard ``k`` is namespace ``scale-k`` (``scale`` with one shard, as before), group ``g<i>`` lives
in shard ``i % N``; with the chart's identity each shard is its own release (``watch.namespaces``
its namespace, the CRD left to the bench), so its replicas hold the release's Lease. A storm's
figures gain ``by_shard``: each shard's groups, overhead, last group done and operator CPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.scale_operators import NamedOperator
from tests.cluster.controlplane import ControlPlane
from tests.e2e.test_helm_support import install_chart, operator_kubeconfig


def shard_namespaces(cp: ControlPlane, shards: int) -> list[str]:
    """One namespace per shard (``scale`` alone with one shard)."""
    if shards < 1:
        raise ValueError(f"shards must be at least 1, got {shards}")
    if shards == 1:
        return [cp.create_namespace("scale")]
    return [cp.create_namespace(f"scale-{k}") for k in range(shards)]


def shard_operators(
    cp: ControlPlane, namespaces: list[str], replicas: int, work: Path, *, as_chart: bool
) -> list[list[NamedOperator]]:
    """Each shard's replicas (not started): with ``as_chart``, one chart release per shard
    (its Deployment parked: the processes play it), else the admin and a Lease per shard."""
    out = []
    for k, ns in enumerate(namespaces):
        prefix = "" if len(namespaces) == 1 else f"s{k}-"
        chart = None
        if as_chart:
            release = install_chart(cp, {"crds": {"enabled": False}, "watch": {"namespaces": [ns]}})
            chart = (operator_kubeconfig(cp, release), release.namespace, release.fullname)
        ops = [
            NamedOperator(cp, ns, work / f"{prefix}op{i}", f"{prefix}op-{i}", chart)
            for i in range(replicas)
        ]
        out.append(ops)
    return out


def per_shard(
    result: dict[str, Any], namespaces: list[str], shard_ops: list[list[NamedOperator]]
) -> None:
    """Each shard's operator CPU into the storm's ``by_shard`` (from its replicas' CPU)."""
    by_replica = result.get("operator_cpu_s_by_replica", {})
    shards = result.setdefault("by_shard", {})
    for ns, ops in zip(namespaces, shard_ops, strict=True):
        cpu = sum(by_replica.get(op.name, 0.0) for op in ops)
        shards.setdefault(ns, {})["operator_cpu_s"] = round(cpu, 2)


def shards_summary(run: dict[str, Any], storm: str = "handover") -> dict[str, Any]:
    """A run's ``storm`` per shard: groups, overhead p99, last group done, operator CPU."""
    shards = run.get(storm, {}).get("by_shard", {})
    return {
        ns: {"groups": f.get("groups"), "overhead_p99_s": f.get("overhead_s", {}).get("p99"),
             "last_done_s": f.get("last_done_s"), "operator_cpu_s": f.get("operator_cpu_s")}
        for ns, f in shards.items()
    }  # fmt: skip
