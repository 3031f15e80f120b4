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
operator CPU seconds and RSS, how often a replica lost its Lease (``leader_lost``), watch event
lag (PATCH answered -> the bench's watch sees it), the operator's mean wait for an API request
slot (per lane: Events, the rest) and the API server's mean answer time
(``omnistage_api_*_seconds``), and where the storm's CPU went (``cpu_s``: the API server, etcd,
localnode, simulated hosts, operators, this process, and ``others_s``, the machine's busy time
that was none of these: other work on a shared machine);
per size: etcd's db size and localnode's own figures. Writes JSON (and an SVG plot of overhead
against stages) under bench/results/.

    .venv/bin/python bench/scale.py --sizes 50,200 --replicas 1,2 [--out bench/results/scale.json]

``--shards N``: the groups spread over N namespaces, each served by its own operator(s) and
Lease (bench/scale_shards.py; each storm's ``by_shard``). ``--operator-cpus``,
``--control-plane-cpus``, ``--harness-cpus``: CPU lists each part is pinned to
(bench/scale_pinning.py). ``--bundle DIR``: a ``bench.gpu_bundle`` folder, unpacked into
``--work`` first, whose binaries run the control plane (a host without the local build):

    python3 bench/scale.py --bundle /tmp/gb --identity admin --sizes 1000 --replicas 1 \
        --shards 2 --operator-cpus 0-1 --control-plane-cpus 0-1 --harness-cpus 2-15

What a hand-over costs the operator as the stages grow (issue 24): ``--storms`` (ondemand and
handover always; ``leader_kill`` adds the later two), ``--idle-s S`` (an ``idle`` window before
the storms and ``idle_after`` after the hand-over storm: the operator's CPU with no storm),
``--settle`` (each window starts once the operator's writes have stopped, and reports
``with_tail``: its figures until they stop again, the Events and follow-up rounds left when the
storm converged; bench/scale_quiet.py), ``--storm-groups K`` (the hand-over storm over the first
K groups, then ``handover_rest`` over the others: two storm sizes among as many stages),
``--profile-dir DIR`` (py-spy, raw, over the operator in each window) and ``--cprofile-dir DIR``
(cProfile over the operator's event-loop thread instead, bench/scale_cprofile.py):

    .venv/bin/python bench/scale.py --sizes 1000 --replicas 1 --storms ondemand,handover \
        --idle-s 30 --settle --storm-groups 100
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import shlex
import sys
import tempfile
import time
from collections.abc import Awaitable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
WORK = Path(tempfile.gettempdir()) / "scale-bundle"


def _bundle(argv: list[str]) -> dict[str, Any] | None:
    """``--bundle``: unpacked (binaries, packages on the path) before the imports below need
    its packages (a GPU host lacks kopf, kr8s, diffusers)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--bundle", type=Path, default=None)
    pre.add_argument("--work", type=Path, default=WORK)
    known, _ = pre.parse_known_args(argv)
    if known.bundle is None:
        return None
    from bench.gpu_e2e_host import unpack_bundle

    return dict(unpack_bundle(known.bundle, known.work), work=str(known.work))


BUNDLE = _bundle(sys.argv[1:]) if __name__ == "__main__" else None

from bench.proc_account import Profile  # noqa: E402
from bench.scale_cprofile import CProfileWindow  # noqa: E402
from bench.scale_cprofile import enable as enable_cprofile  # noqa: E402
from bench.scale_operators import NamedOperator  # noqa: E402
from bench.scale_pinning import Pinning, PinningError  # noqa: E402
from bench.scale_pinning import apply as pin  # noqa: E402
from bench.scale_probe import Probe, etcd_db_bytes  # noqa: E402
from bench.scale_quiet import quiet, writes  # noqa: E402
from bench.scale_report import write_svg  # noqa: E402
from bench.scale_shards import (  # noqa: E402
    per_shard,
    shard_namespaces,
    shard_operators,
    shards_summary,
)
from bench.scale_storms import (  # noqa: E402
    Fleet,
    fleet_targets,
    generate,
    later_storms,
    ondemand_storm,
    patch_storm,
    stage,
    storm_writes,
)
from tests.cluster.build import Binaries, binaries_in  # noqa: E402
from tests.cluster.controlplane import ControlPlane  # noqa: E402
from tests.cluster.kubeconfig import load_kubeconfig  # noqa: E402
from tests.cluster.localnode import LocalNodes  # noqa: E402
from tests.cluster.localnode.api import Api  # noqa: E402

GiB = 1024**3
NO_PINNING = Pinning()
GPUS_PER_NODE = 8
WEIGHTS = 50 * GiB  # two stages of a group never fit one 80 GiB GPU together
STORMS = ("ondemand", "handover", "leader_kill", "unresponsive")
# A window's figures until the operator is quiet again (``--settle``).
WITH_TAIL = (
    "operator_cpu_s",
    "operator_scrape_cpu_s",
    "rounds",
    "rounds_by_cause",
    "apiserver_requests",
    "cpu_s",
)
# The controller-manager without its Endpoints and EndpointSlice controllers: localnode's pods
# have loopback IPs, which both refuse (HTTP 422), and each retried every stage's Service for
# minutes: a third of the API server's requests in a 200-stage storm, a harness cost a real
# cluster does not have (the operator reaches workers by pod IP, not through Services).
CONTROLLERS = "*,-endpoint,-endpointslice,-endpointslicemirroring"


async def _storms(
    cp: ControlPlane, nodes: LocalNodes, namespaces: list[str], *, groups: int,
    shard_ops: list[list[NamedOperator]], model_dir: Path, transfer_s: float,
    storms: frozenset[str] = frozenset(STORMS), idle_s: float = 0.0,
    profile_dir: Path | None = None, settle: bool = False, storm_groups: int = 0,
) -> dict[str, Any]:  # fmt: skip
    api = Api(load_kubeconfig(cp.kubeconfig))
    fleet = Fleet(api, namespaces, groups)
    ops = [op for shard in shard_ops for op in shard]
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
        targets = await fleet_targets(api, fleet)
        await asyncio.gather(*(generate(targets[f"{g}-a"], 600) for g in names))
        await fleet.settle("a", "b", names, 300)
        out["setup"] = {"create_s": round(created, 1), "all_asleep_s": round(pods_s, 1),
                        "first_wake_s": round(time.monotonic() - t0 - pods_s, 1)}  # fmt: skip
        out["setup"].update(Probe.delta(setup_before, probe.snapshot(), time.monotonic() - t0))
        print(f"[scale] setup {out['setup']}", flush=True)

        storm_numbers: dict[str, int] = {}

        async def measured(label: str, storm: Awaitable[dict[str, Any]]) -> None:
            if settle:  # the last window's tail is done: this one starts clean
                await quiet(lambda: writes(cp))
            spy = profiled(ops, profile_dir, label)
            before, t = probe.snapshot(), time.monotonic()
            result = await storm
            storm_numbers[label] = fleet.storm
            mid = probe.snapshot()
            result.update(Probe.delta(before, mid, time.monotonic() - t))
            if settle:  # the storm's work left when it converged: Events, follow-up rounds
                tail_s = await quiet(lambda: writes(cp))
                whole = Probe.delta(before, probe.snapshot(), time.monotonic() - t)
                whole["operator_scrape_cpu_s"] += round(sum(mid["scrape_cpu"].values()), 2)
                result["with_tail"] = {"tail_s": tail_s, "seconds": round(time.monotonic() - t, 1),
                                       **{k: whole[k] for k in WITH_TAIL}}  # fmt: skip
            if spy is not None:
                result["profile"] = spy.stop()
            out[label] = result
            if len(shard_ops) > 1:
                per_shard(result, namespaces, shard_ops)
            print(f"[scale] {label}: {json.dumps(result)}", flush=True)

        if idle_s > 0:  # no storm: what the operator spends on its own (resync, watches)
            await measured("idle", idle(idle_s))
        await measured("ondemand", ondemand_storm(fleet, api, names))
        first = names[:storm_groups] if storm_groups else names
        await measured("handover", patch_storm(fleet, "a", "b", first, within_s=600))
        if len(first) < len(names):  # the other groups' storm: as many stages, fewer groups
            await measured(
                "handover_rest", patch_storm(fleet, "a", "b", names[len(first) :], within_s=600)
            )
        if idle_s > 0:
            await measured("idle_after", idle(idle_s))
        if "leader_kill" in storms:  # with shards: the first shard's leader is killed
            await later_storms(fleet, shard_ops[0], cp, nodes, measured=measured, out=out)
        # each storm's stage writes as the watch saw them, its tail until the next one included
        out["stage_writes"] = {k: storm_writes(fleet, n) for k, n in storm_numbers.items()}
        out["etcd_db_mib"] = round(etcd_db_bytes(cp) / 2**20, 1)
        out["localnode"] = nodes.stats()
        out["bench_api_requests"] = dict(api.requests)
    finally:
        await fleet.stop_watch()
        await api.close()
    return out


async def idle(seconds: float) -> dict[str, Any]:
    """An idle window: no request and no patch from the bench for ``seconds``."""
    await asyncio.sleep(seconds)
    return {"idle_s": seconds}


def profiled(
    ops: list[NamedOperator], folder: Path | None, label: str
) -> Profile | CProfileWindow | None:
    """``py-spy record`` over the first live operator into ``folder/<label>.raw`` (None: no
    folder, or no py-spy beside this Python)."""
    spy = Path(sys.executable).with_name("py-spy")
    live = [op for op in ops if op.alive and op.proc is not None]
    cprofile = os.environ.get("OMNISTAGE_CPROFILE_DIR")
    if cprofile and live:  # --cprofile-dir: the loop's own thread, not py-spy's samples
        return CProfileWindow(live[0].proc.pid, Path(cprofile), label)  # type: ignore[union-attr]
    if folder is None or not spy.exists() or not live:
        return None
    folder.mkdir(parents=True, exist_ok=True)
    return Profile(str(spy), live[0].proc.pid, folder / f"{label}.raw", rate=50)  # type: ignore[union-attr]


def run_size(stages: int, replicas: int, work: Path, *, sim_hosts: int = 10,
             transfer_s: float = 0.1, storms: frozenset[str] = frozenset(STORMS),
             as_chart: bool = True, nice: int = 0, shards: int = 1,
             pinning: Pinning = NO_PINNING, binaries: Binaries | None = None,
             controller_manager: bool = True, idle_s: float = 0.0,
             profile_dir: Path | None = None, settle: bool = False,
             storm_groups: int = 0) -> dict[str, Any]:  # fmt: skip
    """One size with ``replicas`` operators per shard on a fresh control plane: the storms'
    figures.

    ``as_chart``: the operators act as the chart's ServiceAccount (its RBAC, its Lease and the
    FlowSchema that gives the Lease requests the leader-election priority level); off: admin.
    ``nice``: etcd's and the API server's niceness (``ControlPlane(nice=)``). ``shards``:
    namespaces, each with its own operators and Lease (bench/scale_shards.py). ``pinning``:
    CPU sets of the control plane, the operators and the rest (bench/scale_pinning.py)."""
    groups = stages // 2
    node_count = max(1, math.ceil(groups / 2))
    model_dir = work / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()
    started = time.monotonic()
    pinned: dict[str, Any] = {}
    with ControlPlane(controllers=CONTROLLERS, nice=nice, binaries=binaries,
                      controller_manager=controller_manager) as cp:  # fmt: skip
        pinned["control_plane"] = pin(pinning)
        cp.kubectl("apply", "--server-side", "-f", str(ROOT / "crds/omnistages.omnistage.io.yaml"))
        cp.wait_crd_established("omnistages.omnistage.io")
        namespaces = shard_namespaces(cp, shards)
        with LocalNodes(
            cp.kubeconfig, nodes=node_count, gpus=GPUS_PER_NODE, gpu_memory=80 * GiB,
            name_prefix="sim-", sim_hosts=min(sim_hosts, node_count),
            ready_timeout=120 + node_count * 1.0,
        ) as nodes:  # fmt: skip
            nodes_s = nodes.timings["start"]
            shard_ops = shard_operators(cp, namespaces, replicas, work, as_chart=as_chart)
            ops = [op for shard in shard_ops for op in shard]
            for op in ops:
                op.start()
            pinned["operators"] = pin(pinning)
            try:
                result = asyncio.run(
                    _storms(
                        cp, nodes, namespaces, groups=groups, shard_ops=shard_ops,
                        model_dir=model_dir, transfer_s=transfer_s, storms=storms,
                        idle_s=idle_s, profile_dir=profile_dir, settle=settle,
                        storm_groups=storm_groups,
                    )
                )  # fmt: skip
            finally:
                for op in ops:
                    op.stop()
    result.update({
        "stages": stages, "groups": groups, "nodes": node_count, "gpus_per_node": GPUS_PER_NODE,
        "identity": "chart" if as_chart else "admin",
        "controllers": CONTROLLERS if controller_manager else None,
        "control_plane_nice": nice,
        "replicas": replicas, "shards": shards, "shard_namespaces": namespaces,
        "pinning": pinning.record(), "pinned_threads": pinned,
        "nodes_ready_s": round(nodes_s, 1),
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
        "operator_rss_mib_total": max(s["operator_rss_mib_total"] for s in storms),
        "shards": biggest.get("shards", 1),
        **({"handover_by_shard": shards_summary(biggest)} if biggest.get("shards", 1) > 1 else {}),
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
    nice = "etcd's and the API server's niceness: below 0 they go ahead of the harness's other "
    nice += "processes (and other work on the machine), as a control plane on its own cores would"
    p.add_argument("--control-plane-nice", type=int, default=-5, help=nice)
    p.add_argument(
        "--shards",
        type=int,
        default=1,
        help="namespaces, each served by its own operator(s) (times --replicas)",
    )
    for part in ("operator", "control-plane", "harness"):
        p.add_argument(
            f"--{part}-cpus",
            default=None,
            help=f"CPU list (e.g. 0-1) for the {part.replace('-', ' ')} processes",
        )
    p.add_argument("--bundle", type=Path, default=None,
                   help="a bench.gpu_bundle folder: unpack it into --work and use its binaries "
                   "(the controller-manager only if it holds one)")  # fmt: skip
    p.add_argument("--work", type=Path, default=WORK, help="where --bundle is unpacked")
    p.add_argument("--storms", default=",".join(STORMS),
                   help="storms to run (ondemand and handover always run; leader_kill: the "
                   "later two, handover_again/leader_kill and unresponsive)")  # fmt: skip
    p.add_argument("--idle-s", type=float, default=0.0,
                   help="an idle window of this many seconds before the storms and after the "
                   "hand-over storm (the operator's CPU without a storm)")  # fmt: skip
    p.add_argument("--storm-groups", type=int, default=0,
                   help="the hand-over storm over this many groups only, then one over the "
                   "others (handover_rest): storms of two sizes among as many stages")  # fmt: skip
    p.add_argument("--settle", action="store_true",
                   help="each window starts once the operator is quiet, and each reports "
                   "with_tail: its figures until the operator is quiet again")  # fmt: skip
    p.add_argument(
        "--profile-dir",
        type=Path,
        default=None,
        help="py-spy (raw) over the operator in every window, one file each",
    )
    p.add_argument("--cprofile-dir", type=Path, default=None,
                   help="cProfile over the operator's event loop in every window instead "
                   "(bench/scale_cprofile.py), one file each")  # fmt: skip
    args = p.parse_args()
    if args.cprofile_dir is not None:
        enable_cprofile(args.cprofile_dir)
    try:
        pinning = Pinning.parse(args.operator_cpus, args.control_plane_cpus, args.harness_cpus)
    except PinningError as exc:
        p.error(str(exc))
    binaries, controller_manager, bundle = None, True, BUNDLE
    if bundle is not None:
        binaries = binaries_in(args.work / "bin")
        controller_manager = "kube-controller-manager" in bundle["binaries"]
        if args.identity == "chart" and not binaries.helm.is_file():
            p.error("--identity chart needs helm, which the bundle lacks: use --identity admin")
    runs = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for size in [int(s) for s in args.sizes.split(",")]:
        for replicas in [int(r) for r in args.replicas.split(",")]:
            work = Path(tempfile.mkdtemp(prefix=f"scale-{size}-{replicas}-"))
            print(f"[scale] {size} stages, {replicas} replica(s) x {args.shards} shard(s) in "
                  f"{work}", flush=True)  # fmt: skip
            runs.append(run_size(size, replicas, work, sim_hosts=args.sim_hosts,
                                 transfer_s=args.transfer_s,
                                 as_chart=args.identity == "chart",
                                 nice=args.control_plane_nice, shards=args.shards,
                                 pinning=pinning, binaries=binaries,
                                 controller_manager=controller_manager,
                                 storms=frozenset(args.storms.split(",")),
                                 idle_s=args.idle_s, settle=args.settle,
                                 storm_groups=args.storm_groups,
                                 profile_dir=args.profile_dir
                                 and args.profile_dir / f"{size}-{replicas}"))  # fmt: skip
            args.out.write_text(json.dumps({"partial": True, "runs": runs}, indent=1) + "\n")
    result = {
        "benchmark": "scale",
        "command": " ".join(shlex.quote(a) for a in [".venv/bin/python", *sys.argv]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "note": "shared 2-core machine: control plane, localnode, simulated hosts, operators"
            if (os.cpu_count() or 0) <= 2
            else "",
        },
        "bundle": bundle,
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
