"""Scale: hundreds of simulated GPU nodes and thousands of stages on the local control plane.

For each size (stages; two per group, two groups per node, 8 simulated GPUs per node) and each
replica count, a fresh control plane, localnode with simulated worker hosts
(``tests/scale/simhost.py``: real worker gRPC and ACKs over the simulated GPU's physics, no
model) and the real operator(s), then storms over every group at once (bench/scale_storms.py):

1. ``ondemand``: a request to every sleeping OnDemand stage at once (each is a hand-over);
2. ``handover``: ``spec.state: Active`` patched on every group's other stage at once;
3. ``leader_kill`` (2 replicas; with 1 a second hand-over storm): the leader SIGKILLed once a
   third of the groups have handed over;
4. ``unresponsive``: one simulated host in 10 stopped (SIGSTOP: its workers answer nothing),
   then a hand-over storm; convergence is that of the groups on the other hosts.

Reported per storm: per-hand-over operator overhead p50/p95/p99 (latency less both ACKs' own
durations), convergence time, the operator's API requests and objects read per round and per
second (its ``omnistage_round_api_*`` counters) and the most one group's rounds read per round,
operator CPU seconds and RSS, watch event lag (PATCH answered -> the bench's watch sees it),
the operator's mean wait for an API request slot (per lane: Events, the rest) and the API
server's mean answer time (``omnistage_api_*_seconds``), and where the storm's CPU went
(``cpu_s``: the API server, etcd, localnode, simulated hosts, operators, this process, and
``others_s``, the machine's busy time that was none of these: other work on a shared machine);
per size: etcd's db size and localnode's own figures. Writes JSON (and an SVG plot of overhead
against stages) under bench/results/.

    .venv/bin/python bench/scale.py --sizes 50,200 --replicas 1,2 [--out bench/results/scale.json]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import os
import platform
import re
import shlex
import signal
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.scale_report import percentiles, write_svg  # noqa: E402
from bench.scale_storms import Fleet, bounded, generate, pod_targets, stage  # noqa: E402
from tests.cluster.controlplane import ControlPlane  # noqa: E402
from tests.cluster.kubeconfig import load_kubeconfig  # noqa: E402
from tests.cluster.localnode import LocalNodes  # noqa: E402
from tests.cluster.localnode.api import Api  # noqa: E402
from tests.e2e.conftest import OperatorProcess  # noqa: E402
from tests.e2e.test_helm_support import install_chart, operator_kubeconfig  # noqa: E402

GiB = 1024**3
GPUS_PER_NODE = 8
WEIGHTS = 50 * GiB  # two stages of a group never fit one 80 GiB GPU together
STORMS = ("ondemand", "handover", "leader_kill", "unresponsive")
# The operator's own election timing (lease 15 s, renew deadline 10 s): a shorter deadline
# loses the Lease on this loaded 2-core machine, where a renewal itself can take seconds.
TIMING: list[str] = []


class NamedOperator(OperatorProcess):
    """An operator replica with its own identity (``POD_NAME``) and election timing.

    ``chart``: (kubeconfig, release namespace, release full name): act as the chart's pod would,
    with its ServiceAccount's token and its Lease (so the chart's FlowSchema serves the Lease
    requests); None: the admin identity (APF exempts it) and the Lease ``omnistage-operator``
    in ``namespace``.
    """

    def __init__(
        self, cp: ControlPlane, namespace: str, workdir: Path, name: str,
        chart: tuple[Path, str, str] | None = None,
    ) -> None:  # fmt: skip
        workdir.mkdir(parents=True, exist_ok=True)
        super().__init__(cp, namespace, workdir, chart[0] if chart else None)
        self.name = name
        self.extra = [*TIMING]
        self.lease = (chart[1], chart[2]) if chart else (namespace, "omnistage-operator")

    def start(self) -> None:
        env = {"POD_NAME": self.name}
        if self.lease[1] != "omnistage-operator":
            env.update(POD_NAMESPACE=self.lease[0], OMNISTAGE_LEASE_NAME=self.lease[1])
        os.environ.update(env)
        try:
            super().start()
        finally:
            for key in env:
                os.environ.pop(key, None)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def counters(text: str, name: str, label: str = "group") -> dict[str, float]:
    """A counter's samples by their ``label`` (summed over other labels)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            m = re.search(label + r'="([^"]*)"', line)
            key = m.group(1) if m else ""
            out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


# The operator's API requests: time waiting for a request slot (by lane), time the API server
# took (all verbs).
API_TIMES = {
    "api_wait": ("omnistage_api_wait_seconds", "lane"),
    "api_request": ("omnistage_api_request_seconds", "verb"),
}


def api_times(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Mean seconds per request of a storm: waiting for a slot (per lane), at the API server."""
    out: dict[str, Any] = {}
    for key in API_TIMES:
        total: dict[str, list[float]] = {}
        for name, m in after.items():
            b = before.get(name, {})
            for part in ("sum", "count"):
                for lane, v in m.get(f"{key}_{part}", {}).items():
                    got = total.setdefault(lane, [0.0, 0.0])
                    got[part == "count"] += v - b.get(f"{key}_{part}", {}).get(lane, 0.0)
        out[f"{key}_mean_s"] = {
            lane or "all": round(s / c, 3) for lane, (s, c) in sorted(total.items()) if c > 0
        }
    return out


# Where the CPU of a storm goes: this process's descendants by what they run (the rest of the
# machine's busy time is other work on it). The control plane's binaries by name (their cache
# directory's name holds "etcd"), the Python ones by module or script.
BINARIES = {
    "kube-apiserver": "apiserver",
    "etcd": "etcd",
    "kube-scheduler": "scheduler",
    "kube-controller-manager": "controller_manager",
}
SCRIPTS = (
    ("tests.scale.simhost", "simhosts"),
    ("tests.cluster.localnode", "localnode"),
    ("omnistage-operator", "operators"),
)


def stack_cpu() -> dict[str, float]:
    """CPU seconds so far: the harness's processes by kind (``bench``: this one), and the
    whole machine's busy time (``machine``; every core)."""
    me = psutil.Process()
    out = {"bench": sum(me.cpu_times()[:2])}
    for child in me.children(recursive=True):
        try:
            argv = child.cmdline()
            t = child.cpu_times()
        except psutil.Error:
            continue
        cmd = " ".join(argv)
        kind = BINARIES.get(Path(argv[0]).name if argv else "") or next(
            (k for needle, k in SCRIPTS if needle in cmd), "other_children"
        )
        out[kind] = out.get(kind, 0.0) + t.user + t.system
    m = psutil.cpu_times()
    out["machine"] = sum(m) - m.idle - getattr(m, "iowait", 0.0)
    return out


def cpu_breakdown(
    before: dict[str, float], after: dict[str, float], seconds: float
) -> dict[str, Any]:
    """A storm's CPU seconds by kind, the machine's busy seconds and the share of them that was
    not the harness's (``others``: other work on a shared machine), and how busy the machine
    was. A process that ends during the storm drops out (``leader_kill``'s killed operator: its
    kind reads low, at least 0; ``operator_cpu_s`` counts the replicas alive at the end)."""
    kinds = {k: round(max(after.get(k, 0.0) - before.get(k, 0.0), 0.0), 2) for k in after}
    machine = kinds.pop("machine")
    ours = sum(kinds.values())
    cores = psutil.cpu_count() or 1
    return {
        **kinds,
        "machine_busy_s": machine,
        "others_s": round(max(machine - ours, 0.0), 2),
        "machine_busy_fraction": round(machine / max(seconds * cores, 1e-6), 3),
    }


def apiserver_requests(cp: ControlPlane) -> dict[str, float]:
    """The API server's requests so far (every client), by ``VERB resource[/subresource]``."""
    text = cp.kubectl("get", "--raw", "/metrics").stdout
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("apiserver_request_total{"):
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
        what = labels.get("resource", "") + (
            f"/{labels['subresource']}" if labels.get("subresource") else ""
        )
        key = f"{labels.get('verb', '')} {what}"
        out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


class Probe:
    """Operator figures over a storm: counters, CPU, RSS (alive replicas only), and the CPU of
    every process of the harness and of the machine (``stack_cpu``)."""

    def __init__(self, ops: list[NamedOperator], cp: ControlPlane | None = None) -> None:
        self.ops = ops
        self.cp = cp

    def snapshot(self) -> dict[str, Any]:
        snap: dict[str, Any] = {"cpu": {}, "rss": {}, "metrics": {}, "stack": stack_cpu()}
        snap["apiserver"] = apiserver_requests(self.cp) if self.cp is not None else {}
        for op in self.ops:
            if not op.alive or op.proc is None:
                continue
            p = psutil.Process(op.proc.pid)
            t = p.cpu_times()
            snap["cpu"][op.name] = t.user + t.system
            snap["rss"][op.name] = p.memory_info().rss
            try:
                text = op.metrics()
            except OSError:
                continue
            snap["metrics"][op.name] = {
                k: counters(text, f"omnistage_{k}_total")
                for k in ("rounds", "round_api_requests", "round_api_objects")
            }
            for key, (name, label) in API_TIMES.items():
                for part in ("sum", "count"):
                    by = counters(text, f"{name}_{part}", label)
                    if label == "verb":  # every verb together
                        by = {"": sum(by.values())}
                    snap["metrics"][op.name][f"{key}_{part}"] = by
        return snap

    @staticmethod
    def delta(before: dict[str, Any], after: dict[str, Any], seconds: float) -> dict[str, Any]:
        names = [n for n in after["metrics"] if n in before["metrics"]]

        def summed(kind: str) -> dict[str, float]:
            out: dict[str, float] = {}
            for n in names:
                for g, v in after["metrics"][n][kind].items():
                    out[g] = out.get(g, 0.0) + v - before["metrics"][n][kind].get(g, 0.0)
            return out

        rounds, reqs, objs = (
            summed("rounds"),
            summed("round_api_requests"),
            summed("round_api_objects"),
        )
        total_rounds = sum(rounds.values())
        per_group = [objs.get(g, 0.0) / r for g, r in rounds.items() if r > 0]
        cpu = sum(after["cpu"][n] - before["cpu"].get(n, after["cpu"][n]) for n in after["cpu"])
        return {
            "rounds": int(total_rounds),
            "api_requests_per_round": round(sum(reqs.values()) / max(total_rounds, 1), 2),
            "api_objects_per_round": round(sum(objs.values()) / max(total_rounds, 1), 2),
            "api_objects_per_round_max_group": round(max(per_group, default=0.0), 2),
            "api_objects_max_group": round(max(objs.values(), default=0.0), 1),
            "api_requests_per_s": round(sum(reqs.values()) / max(seconds, 1e-6), 1),
            "api_objects_per_s": round(sum(objs.values()) / max(seconds, 1e-6), 1),
            "operator_cpu_s": round(cpu, 2),
            "operator_rss_mib": round(max(after["rss"].values(), default=0) / 2**20, 1),
            **api_times(
                {n: before["metrics"][n] for n in names}, {n: after["metrics"][n] for n in names}
            ),
            "cpu_s": cpu_breakdown(before["stack"], after["stack"], seconds),
            "apiserver_requests": {
                k: int(v - before["apiserver"].get(k, 0.0))
                for k, v in sorted(after["apiserver"].items())
                if v - before["apiserver"].get(k, 0.0) >= 1 and not k.startswith("WATCH")
            },
        }


def etcd_db_bytes(cp: ControlPlane) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{cp.etcd_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    m = re.search(r"^etcd_mvcc_db_total_size_in_bytes (\S+)$", text, re.M)
    return int(float(m.group(1))) if m else 0


async def _patch_storm(
    fleet: Fleet, gainer: str, loser: str, groups: list[str], *, within_s: float,
    during: Any = None,
) -> dict[str, Any]:  # fmt: skip
    """Patch every group's ``gainer`` Active at once; latencies, overheads, watch lag."""
    fleet.storm += 1
    n = fleet.storm
    t0 = time.monotonic()
    side = asyncio.create_task(during(fleet, gainer, groups)) if during else None
    patches = await bounded(
        [functools.partial(fleet.patch_state, f"{g}-{gainer}", "Active") for g in groups]
    )
    try:
        await fleet.settle(gainer, loser, groups, within_s)
    finally:
        if side is not None:
            side.cancel()
    converge = time.monotonic() - t0
    latency, overhead, lag = [], [], []
    for g, (tp, tr, rv) in zip(groups, patches, strict=True):
        seen = fleet.seen[f"{g}-{gainer}"]
        lat = seen.active_at[n] - tp
        latency.append(lat)
        overhead.append(fleet.overhead(f"{g}-{gainer}", f"{g}-{loser}", lat))
        if rv in seen.rv_seen:
            lag.append(max(seen.rv_seen[rv] - tr, 0.0))
    return {
        "groups": len(groups),
        "converge_s": round(converge, 2),
        "latency_s": percentiles(latency),
        "overhead_s": percentiles(overhead),
        "watch_lag_s": percentiles(lag),
        "patches_sent_s": round(max(tr for _, tr, _ in patches) - t0, 2),
    }


async def _ondemand_storm(fleet: Fleet, api: Api, ns: str, groups: list[str]) -> dict[str, Any]:
    """A request to every group's sleeping ``b`` at once."""
    fleet.storm += 1
    targets = await pod_targets(api, ns)
    t0 = time.monotonic()
    answers = await asyncio.gather(
        *(generate(targets[f"{g}-b"], 600) for g in groups), return_exceptions=True
    )
    converge = time.monotonic() - t0
    await fleet.settle("b", "a", groups, 120)
    ok = [(g, a) for g, a in zip(groups, answers, strict=True) if isinstance(a, float)]
    failed = [repr(a) for a in answers if not isinstance(a, float)]
    return {
        "groups": len(groups),
        "answered": len(ok),
        "failed": failed[:5],
        "converge_s": round(converge, 2),
        "latency_s": percentiles([a for _, a in ok]),
        "overhead_s": percentiles([fleet.overhead(f"{g}-b", f"{g}-a", a) for g, a in ok]),
    }


async def _kill_leader_midway(
    ops: list[NamedOperator], cp: ControlPlane, ns: str, *, fleet: Fleet, gainer: str,
    groups: list[str],
) -> None:  # fmt: skip
    """SIGKILL the Lease holder once a third of the groups' gainers are Active."""
    third = max(1, len(groups) // 3)
    while sum(fleet.seen[f"{g}-{gainer}"].state == "Active" for g in groups) < third:  # noqa: ASYNC110
        await asyncio.sleep(0.1)
    lease_ns, lease_name = ops[0].lease
    holder = cp.get_json("lease", lease_name, namespace=lease_ns)["spec"]["holderIdentity"]
    for op in ops:
        if holder.startswith(op.name) and op.proc is not None:
            print(f"[scale] killing the leader {op.name} mid-storm", flush=True)
            op.proc.send_signal(signal.SIGKILL)
            op.proc.wait(30)


async def _later_storms(
    fleet: Fleet, ops: list[NamedOperator], cp: ControlPlane, nodes: LocalNodes, *,
    measured: Callable[[str, Awaitable[dict[str, Any]]], Awaitable[None]], out: dict[str, Any],
) -> None:  # fmt: skip
    """The leader killed mid-storm (or a second hand-over storm with one replica), then one
    simulated host in ten stopped during a hand-over storm of the others."""
    names = fleet.groups
    if len(ops) > 1:

        async def kill(f: Fleet, gainer: str, gs: list[str]) -> None:
            await _kill_leader_midway(ops, cp, fleet.ns, fleet=f, gainer=gainer, groups=gs)

        await measured(
            "leader_kill", _patch_storm(fleet, "b", "a", names, within_s=600, during=kill)
        )
    else:
        await measured("handover_again", _patch_storm(fleet, "b", "a", names, within_s=600))
    # every a withdraws its (lost) wish, so its next Active is a new ask
    await bounded([functools.partial(fleet.patch_state, f"{g}-a", "Asleep") for g in names])
    await asyncio.sleep(2)
    hosts = nodes.sim_hosts()
    frozen_nodes = set(hosts[0]["nodes"]) if len(hosts) >= 10 else set()
    frozen = [g for i, g in enumerate(names) if nodes.node_names[i // 2] in frozen_nodes]
    live = [g for g in names if g not in frozen]
    if frozen:
        os.kill(hosts[0]["pid"], signal.SIGSTOP)
    try:
        await measured("unresponsive", _patch_storm(fleet, "a", "b", live, within_s=600))
        out["unresponsive"]["frozen_groups"] = len(frozen)
        out["unresponsive"]["frozen_converged"] = sum(
            fleet.seen[f"{g}-a"].state == "Active" for g in frozen
        )
    finally:
        if frozen:
            os.kill(hosts[0]["pid"], signal.SIGCONT)


async def _storms(
    cp: ControlPlane, nodes: LocalNodes, ns: str, *, groups: int, ops: list[NamedOperator],
    model_dir: Path, transfer_s: float, storms: frozenset[str] = frozenset(STORMS),
) -> dict[str, Any]:  # fmt: skip
    api = Api(load_kubeconfig(cp.kubeconfig))
    fleet = Fleet(api, ns, groups)
    probe = Probe(ops, cp)
    env = {"OMNISTAGE_SIM_WEIGHTS": str(WEIGHTS), "OMNISTAGE_SIM_TRANSFER_S": str(transfer_s)}
    names = fleet.groups
    out: dict[str, Any] = {}
    try:
        fleet.start_watch()
        setup_before = probe.snapshot()
        t0 = time.monotonic()
        manifests = []
        for i, g in enumerate(names):
            node = nodes.node_names[i // 2]
            for s in ("a", "b"):
                manifests.append(
                    stage(f"{g}-{s}", g, node, model_dir=str(model_dir), state="Asleep", env=env)
                )
        await fleet.create(manifests)
        created = time.monotonic() - t0
        # both asleep first, then a request wakes each group's a (memory free: no hand-over)
        await fleet.settle_both_asleep(names, 120 + 2.0 * len(manifests))
        pods_s = time.monotonic() - t0
        targets = await pod_targets(api, ns)
        await asyncio.gather(*(generate(targets[f"{g}-a"], 600) for g in names))
        await fleet.settle("a", "b", names, 300)
        out["setup"] = {"create_s": round(created, 1), "all_asleep_s": round(pods_s, 1),
                        "first_wake_s": round(time.monotonic() - t0 - pods_s, 1)}  # fmt: skip
        out["setup"].update(Probe.delta(setup_before, probe.snapshot(), time.monotonic() - t0))
        print(f"[scale] setup {out['setup']}", flush=True)

        async def measured(label: str, storm: Awaitable[dict[str, Any]]) -> None:
            before, t = probe.snapshot(), time.monotonic()
            result = await storm
            result.update(Probe.delta(before, probe.snapshot(), time.monotonic() - t))
            out[label] = result
            print(f"[scale] {label}: {json.dumps(result)}", flush=True)

        await measured("ondemand", _ondemand_storm(fleet, api, ns, names))
        await measured("handover", _patch_storm(fleet, "a", "b", names, within_s=600))
        if "leader_kill" in storms:
            await _later_storms(fleet, ops, cp, nodes, measured=measured, out=out)
        out["etcd_db_mib"] = round(etcd_db_bytes(cp) / 2**20, 1)
        out["localnode"] = nodes.stats()
        out["bench_api_requests"] = dict(api.requests)
    finally:
        await fleet.stop_watch()
        await api.close()
    return out


def run_size(stages: int, replicas: int, work: Path, *, sim_hosts: int = 10,
             transfer_s: float = 0.1, storms: frozenset[str] = frozenset(STORMS),
             as_chart: bool = True) -> dict[str, Any]:  # fmt: skip
    """One size with ``replicas`` operators on a fresh control plane: the storms' figures.

    ``as_chart``: the operators act as the chart's ServiceAccount (its RBAC, its Lease and the
    FlowSchema that gives the Lease requests the leader-election priority level); off: admin."""
    groups = stages // 2
    node_count = max(1, math.ceil(groups / 2))
    model_dir = work / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()
    started = time.monotonic()
    with ControlPlane() as cp:
        cp.kubectl("apply", "--server-side", "-f", str(ROOT / "crds/omnistages.omnistage.io.yaml"))
        cp.wait_crd_established("omnistages.omnistage.io")
        ns = cp.create_namespace("scale")
        with LocalNodes(
            cp.kubeconfig, nodes=node_count, gpus=GPUS_PER_NODE, gpu_memory=80 * GiB,
            name_prefix="sim-", sim_hosts=min(sim_hosts, node_count),
            ready_timeout=120 + node_count * 1.0,
        ) as nodes:  # fmt: skip
            nodes_s = nodes.timings["start"]
            chart = None
            if as_chart:  # the chart's objects, its Deployment parked: the processes play it
                release = install_chart(cp, {"crds": {"enabled": False},
                                             "watch": {"namespaces": [ns]}})  # fmt: skip
                kubeconfig = operator_kubeconfig(cp, release)
                chart = (kubeconfig, release.namespace, release.fullname)
            ops = [NamedOperator(cp, ns, work / f"op{i}", f"op-{i}", chart)
                   for i in range(replicas)]  # fmt: skip
            for op in ops:
                op.start()
            try:
                result = asyncio.run(
                    _storms(
                        cp, nodes, ns, groups=groups, ops=ops, model_dir=model_dir,
                        transfer_s=transfer_s, storms=storms,
                    )
                )  # fmt: skip
            finally:
                for op in ops:
                    op.stop()
    result.update({
        "stages": stages, "groups": groups, "nodes": node_count, "gpus_per_node": GPUS_PER_NODE,
        "identity": "chart" if as_chart else "admin",
        "replicas": replicas, "nodes_ready_s": round(nodes_s, 1),
        "load_avg_at_start": [round(x, 2) for x in load],
        "wall_s": round(time.monotonic() - started, 1),
    })  # fmt: skip
    return result


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The headline figures of the largest size run (1 replica first)."""
    biggest = max(runs, key=lambda r: (r["stages"], -r["replicas"]))
    storms = [biggest[k] for k in ("ondemand", "handover", "handover_again", "leader_kill")
              if k in biggest]  # fmt: skip
    return {
        "stages": biggest["stages"],
        "nodes": biggest["nodes"],
        "replicas": biggest["replicas"],
        "storm_overhead_p99_s": max(s["overhead_s"]["p99"] for s in storms),
        "storm_converge_s": max(s["converge_s"] for s in storms),
        "operator_rss_mib": max(s["operator_rss_mib"] for s in storms),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="50,200", help="stage counts, comma-separated")
    p.add_argument("--replicas", default="1,2", help="operator replica counts")
    p.add_argument("--sim-hosts", type=int, default=10)
    p.add_argument("--transfer-s", type=float, default=0.1, help="seconds per simulated move")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "scale.json")
    identity = "the operators' API identity: the chart's ServiceAccount (its RBAC and Lease "
    identity += "FlowSchema) or the admin (exempt from API Priority and Fairness)"
    p.add_argument("--identity", choices=("chart", "admin"), default="chart", help=identity)
    args = p.parse_args()
    runs = []
    for size in [int(s) for s in args.sizes.split(",")]:
        for replicas in [int(r) for r in args.replicas.split(",")]:
            work = Path(tempfile.mkdtemp(prefix=f"scale-{size}-{replicas}-"))
            print(f"[scale] {size} stages, {replicas} replica(s) in {work}", flush=True)
            runs.append(run_size(size, replicas, work, sim_hosts=args.sim_hosts,
                                 transfer_s=args.transfer_s,
                                 as_chart=args.identity == "chart"))  # fmt: skip
            args.out.write_text(json.dumps({"partial": True, "runs": runs}, indent=1) + "\n")
    result = {
        "benchmark": "scale",
        "command": " ".join(shlex.quote(a) for a in [".venv/bin/python", *sys.argv]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "note": "shared 2-core machine: control plane, localnode, simulated hosts, operators",
        },
        "summary": summary(runs),
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    write_svg(runs, args.out.with_suffix(".svg"))
    print(json.dumps(result["summary"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
