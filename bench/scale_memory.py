"""Operator memory per stage: tracemalloc snapshots of the settled operator at several sizes.

For each size (stages; two per group, as bench/scale.py builds them, no storms): a fresh control
plane, localnode with simulated worker hosts and the real operator run with tracemalloc on (a
``sitecustomize`` put on its ``PYTHONPATH`` dumps a snapshot on SIGUSR2). Once every group has
one stage Active and the other Asleep, and the operator's RSS has settled, a snapshot is taken.
Reported per size: RSS, traced bytes and the top allocation sites, and where the rest is
(``heap``: glibc's main arena in use and free, RSS by kind of mapping, what ``malloc_trim``
then gives back, objects by type); between the first two sizes, bytes per stage by site.
Writes JSON under bench/results/.

    .venv/bin/python bench/scale_memory.py --sizes 200,400 [--out bench/results/scale_memory.json]
    .venv/bin/python bench/scale_memory.py --sizes 200 --compare BEFORE.snapshot AFTER.snapshot
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import shlex
import signal
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.scale import GPUS_PER_NODE, WEIGHTS  # noqa: E402
from bench.scale_operators import NamedOperator  # noqa: E402
from bench.scale_storms import (  # noqa: E402
    Fleet,
    bounded,
    generate,
    patch_storm,
    pod_targets,
    stage,
)
from tests.cluster.controlplane import ControlPlane  # noqa: E402
from tests.cluster.kubeconfig import load_kubeconfig  # noqa: E402
from tests.cluster.localnode import LocalNodes  # noqa: E402
from tests.cluster.localnode.api import Api  # noqa: E402
from tests.e2e.conftest import OPERATOR, WAKE_MARGIN, wait_for  # noqa: E402

GiB = 1024**3
HOOK = """\
import collections, ctypes, gc, json, os, signal, tracemalloc
class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
def _heap():
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    types = collections.Counter(type(o).__qualname__ for o in gc.get_objects())
    return {"malloc_in_use": info.uordblks, "malloc_free": info.fordblks,
            "malloc_mmapped": info.hblkhd, "malloc_arena": info.arena,
            "gc_objects": sum(types.values()), "gc_types": dict(types.most_common(30)),
            "rss_by_kind": _rss_by_kind(), "rss_trimmed": _trimmed(libc),
            "held_by": {t: _chains(t) for t in
                        os.environ.get("OMNISTAGE_HELD_BY", "").split(",") if t}}
def _rss():
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
def _trimmed(libc):
    before = _rss()
    libc.malloc_trim(0)
    return before - _rss()
def _rss_by_kind():
    kinds, kind = collections.Counter(), "anon"
    with open("/proc/self/smaps") as fh:
        for line in fh:
            head = line.split()
            if head and "-" in head[0] and ":" not in head[0]:
                path = head[5] if len(head) > 5 else ""
                kind = "heap" if path == "[heap]" else "anon" if not path else (
                    "stack" if path.startswith("[stack") else "file")
            elif head and head[0] == "Rss:":
                kinds[kind] += int(head[1]) * 1024
    return dict(kinds)
def _chains(type_name, samples=3, depth=6):
    # a few live objects of type_name: what holds them, depth referrers up
    found = [o for o in gc.get_objects() if type(o).__name__ == type_name][-samples:]
    out = []
    for obj in found:
        chain, node, ignore = [], obj, {id(found)}
        for _ in range(depth):
            refs = gc.get_referrers(node)
            ignore.add(id(refs))
            holders = [r for r in refs if id(r) not in ignore and type(r).__name__ != "frame"]
            if not holders:
                break
            node = holders[0]
            ignore.add(id(node))
            what = type(node).__qualname__
            if isinstance(node, dict):
                what += "{" + ",".join(sorted(map(str, node))[:6]) + "}"
            chain.append(what)
        out.append(chain)
    return out
def _dump(signum, frame):
    out = os.environ["OMNISTAGE_TRACEMALLOC_OUT"]
    with open(out + ".heap.json", "w") as fh:
        json.dump(_heap(), fh)
    tracemalloc.take_snapshot().dump(out)
if os.environ.get("OMNISTAGE_TRACEMALLOC_OUT"):
    tracemalloc.start(int(os.environ.get("OMNISTAGE_TRACEMALLOC_DEPTH", "1")))
    signal.signal(signal.SIGUSR2, _dump)
"""


async def _settle(
    cp: ControlPlane, nodes: LocalNodes, ns: str, groups: int, model: Path,
    *, storms: int = 0, taken: Callable[[str], Awaitable[None]] | None = None,
) -> None:  # fmt: skip
    """Create the stages, wake every group's ``a``; then ``storms`` hand-over storms (every
    group at once, ``b`` and ``a`` in turn), ``taken(label)`` after each."""
    api = Api(load_kubeconfig(cp.kubeconfig))
    fleet = Fleet(api, ns, groups)
    env = {"OMNISTAGE_SIM_WEIGHTS": str(WEIGHTS), "OMNISTAGE_SIM_TRANSFER_S": "0.1"}
    try:
        fleet.start_watch()
        manifests = [
            stage(
                f"{g}-{s}",
                g,
                nodes.node_names[i // 2],
                model_dir=str(model),
                state="Asleep",
                env=env,
            )
            for i, g in enumerate(fleet.groups)
            for s in ("a", "b")
        ]
        await fleet.create(manifests)
        await fleet.settle_both_asleep(fleet.groups, 120 + 2.0 * len(manifests))
        targets = await pod_targets(api, ns)
        await asyncio.gather(*(_served(targets[f"{g}-a"]) for g in fleet.groups))
        await fleet.settle("a", "b", fleet.groups, 300)
        for n in range(storms):
            if taken is not None:
                await taken(f"storm{n}")
            gainer, loser = ("b", "a") if n % 2 == 0 else ("a", "b")
            await patch_storm(fleet, gainer, loser, fleet.groups, within_s=300)
            # the loser withdraws its wish (it lost), so its next Active is a new ask
            await bounded(
                [partial(fleet.patch_state, f"{g}-{loser}", "Asleep") for g in fleet.groups]
            )
    finally:
        await fleet.stop_watch()
        await api.close()


async def _served(target: str, tries: int = 5) -> None:
    """A request answered: one the worker held past its hold timeout while its stage woke
    (500 wakes at once on a loaded machine) is sent again."""
    for attempt in range(tries):
        try:
            await generate(target, 600)
            return
        except grpc.aio.AioRpcError as exc:
            if exc.code() is not grpc.StatusCode.UNAVAILABLE or attempt == tries - 1:
                raise


def _rss_settled(pid: int, within_s: float = 120, step_s: float = 5) -> int:
    """The process's RSS once it changed less than 1% over ``step_s``."""
    proc, deadline = psutil.Process(pid), time.monotonic() + within_s
    last = proc.memory_info().rss
    while time.monotonic() < deadline:
        time.sleep(step_s)
        now = proc.memory_info().rss
        if abs(now - last) < last / 100:
            return now
        last = now
    return last


def _snapshot(pid: int, path: Path, within_s: float = 120) -> tracemalloc.Snapshot:
    os.kill(pid, signal.SIGUSR2)
    deadline, size = time.monotonic() + within_s, -1
    while time.monotonic() < deadline:
        time.sleep(1)
        now = path.stat().st_size if path.exists() else -1
        if now > 0 and now == size:
            return tracemalloc.Snapshot.load(str(path))
        size = now
    raise TimeoutError(f"no tracemalloc snapshot at {path}")


def _start(op: NamedOperator, within_s: float = 600) -> None:
    """Start the operator; traced, it imports slowly on a loaded machine (no 60 s limit)."""
    env = {**os.environ, "KUBECONFIG": str(op.kubeconfig), "PYTHONUNBUFFERED": "1",
           "POD_NAME": op.name}  # fmt: skip
    argv = [
        OPERATOR, "--namespace", op.namespace, *op.auth,
        "--metrics-port", str(op.metrics_port), "--liveness-port", str(op.liveness_port),
        "--wake-margin-bytes", str(WAKE_MARGIN),
    ]  # fmt: skip
    op.spawn(argv, env)  # dies with this process
    try:
        wait_for("operator liveness endpoint", op._healthy, within_s)
    except BaseException:
        op.stop()
        raise


def _point(
    pid: int, snap_path: Path, label: str, quiet_s: float = 0.0
) -> tuple[dict[str, Any], Any]:
    """After ``quiet_s`` without requests, the settled RSS, then a snapshot (its files removed
    once read): a row and its stats."""
    time.sleep(quiet_s)
    rss = _rss_settled(pid)
    snap = _snapshot(pid, snap_path)
    heap_path = Path(f"{snap_path}.heap.json")
    heap = json.loads(heap_path.read_text())
    snap_path.unlink()
    heap_path.unlink()
    stats = _own(snap)
    traced = _traced_bytes(stats)
    row = {"label": label, "rss_mib": round(rss / 2**20, 1), "traced_mib": round(traced / 2**20, 1),
           "heap": heap}  # fmt: skip
    return row, stats


def measure(
    stages: int,
    work: Path,
    sim_hosts: int,
    depth: int,
    *,
    storms: int = 0,
    top: int = 25,
    quiet_s: float = 0.0,
) -> tuple[dict[str, Any], Any]:
    """One size: RSS, traced bytes and the snapshot's statistics by line; with ``storms``, the
    same before each hand-over storm and what grew from the second to the end."""
    groups = stages // 2
    node_count = max(1, math.ceil(groups / 2))
    model = work / "model"
    model.mkdir(parents=True, exist_ok=True)
    hook = work / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(HOOK)
    snap_path = work / "operator.snapshot"
    points: list[dict[str, Any]] = []
    kept: dict[str, Any] = {}
    with ControlPlane() as cp:
        cp.kubectl("apply", "--server-side", "-f", str(ROOT / "crds/omnistages.omnistage.io.yaml"))
        cp.wait_crd_established("omnistages.omnistage.io")
        ns = cp.create_namespace("scale")
        with LocalNodes(
            cp.kubeconfig, nodes=node_count, gpus=GPUS_PER_NODE, gpu_memory=80 * GiB,
            name_prefix="sim-", sim_hosts=min(sim_hosts, node_count),
            ready_timeout=120 + node_count * 1.0,
        ) as nodes:  # fmt: skip
            op = NamedOperator(cp, ns, work / "op0", "op-0")
            saved = dict(os.environ)
            os.environ["OMNISTAGE_TRACEMALLOC_OUT"] = str(snap_path)
            os.environ["OMNISTAGE_TRACEMALLOC_DEPTH"] = str(depth)
            os.environ["PYTHONPATH"] = os.pathsep.join(
                [str(hook), *filter(None, [saved.get("PYTHONPATH")])]
            )
            try:
                _start(op)
            finally:
                os.environ.clear()
                os.environ.update(saved)
            assert op.proc is not None
            pid = op.proc.pid

            async def taken(label: str) -> None:
                row, stats = await asyncio.to_thread(_point, pid, snap_path, label, quiet_s)
                print(json.dumps({k: v for k, v in row.items() if k != "heap"}), flush=True)
                points.append(row)
                kept[label] = stats

            try:
                t0 = time.monotonic()
                asyncio.run(_settle(cp, nodes, ns, groups, model, storms=storms, taken=taken))
                settled_s = time.monotonic() - t0
                end, stats = _point(pid, snap_path, "end", quiet_s)
            finally:
                op.stop()
    row = {"stages": stages, "groups": groups, "nodes": node_count,
           "settle_s": round(settled_s, 1), "rss_mib": end["rss_mib"],
           "traced_mib": end["traced_mib"], "heap": end["heap"]}  # fmt: skip
    if storms >= 2:
        first = points[1]  # after one storm: what a storm first allocates is there already
        row["storms"] = storms
        row["points"] = [*points, end]
        row["growth_per_storm"] = {
            "storms": storms - 1,
            "rss_mib": round((end["rss_mib"] - first["rss_mib"]) / (storms - 1), 2),
            "traced_mib": round((end["traced_mib"] - first["traced_mib"]) / (storms - 1), 2),
            "by_site_bytes": {
                _site(d): round(d.size_diff / (storms - 1))
                for d in stats.compare_to(kept["storm1"], _key_type(depth))[:top]
            },
        }
    return row, stats


def _frame(frame: Any) -> str:
    name = frame.filename
    for marker in ("site-packages/", "/src/", "/lib/python3"):
        if marker in name:
            name = name.split(marker, 1)[1]
            break
    return f"{name}:{frame.lineno}"


def _key_type(depth: int) -> str:
    """Snapshots compared by allocation line, or by whole traceback when traced deeper."""
    return "traceback" if depth > 1 else "lineno"


def _site(stat: Any) -> str:
    """Where ``stat`` was allocated; with deeper tracebacks, the callers after `` < ``."""
    return " < ".join(_frame(f) for f in reversed(list(stat.traceback)[-4:]))


def _own(snap: tracemalloc.Snapshot) -> tracemalloc.Snapshot:
    """The operator's allocations, without tracemalloc's own."""
    return snap.filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])


def _traced_bytes(snap: tracemalloc.Snapshot) -> int:
    return sum(s.size for s in snap.statistics("filename"))


def _load(path: Path) -> tracemalloc.Snapshot:
    return _own(tracemalloc.Snapshot.load(str(path)))


def compare(before: Path, after: Path, *, stages: int, top: int, out: Path) -> int:
    """Bytes per stage by site between two snapshots of one size (before and after a change)."""
    old, new = _load(before), _load(after)
    diff = new.compare_to(old, "lineno")
    traced = [_traced_bytes(snap) for snap in (old, new)]
    result = {
        "benchmark": "scale_memory_compare",
        "command": " ".join(shlex.quote(a) for a in [".venv/bin/python", *sys.argv]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "stages": stages,
        "traced_mib": {"before": round(traced[0] / 2**20, 1), "after": round(traced[1] / 2**20, 1)},
        "by_site_bytes_per_stage": {_site(d): round(d.size_diff / stages) for d in diff[:top]},
    }
    print(json.dumps(result, indent=1), flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="200,400", help="stage counts, comma-separated")
    p.add_argument("--sim-hosts", type=int, default=10)
    p.add_argument("--depth", type=int, default=1, help="tracemalloc frames per allocation")
    p.add_argument("--top", type=int, default=25)
    p.add_argument(
        "--storms",
        type=int,
        default=0,
        help="hand-over storms after settling, a snapshot before each",
    )
    p.add_argument("--quiet-s", type=float, default=0.0,
                   help="seconds without requests before each snapshot")  # fmt: skip
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "scale_memory.json")
    p.add_argument(
        "--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"),
        help="only compare two saved snapshots of one size (--sizes: that size)",
    )  # fmt: skip
    args = p.parse_args()
    if args.compare:
        return compare(*args.compare, stages=int(args.sizes), top=args.top, out=args.out)
    rows, snaps = [], []
    for size in [int(s) for s in args.sizes.split(",")]:
        work = Path(tempfile.mkdtemp(prefix=f"scale-mem-{size}-"))
        print(f"[scale-memory] {size} stages in {work}", flush=True)
        row, stats = measure(
            size,
            work,
            args.sim_hosts,
            args.depth,
            storms=args.storms,
            top=args.top,
            quiet_s=args.quiet_s,
        )
        row["top"] = {
            _site(s): s.size for s in stats.statistics("lineno")[: args.top]
        }  # fmt: skip
        print(json.dumps(row, indent=1), flush=True)
        rows.append(row)
        snaps.append(stats)
    result: dict[str, Any] = {
        "benchmark": "scale_memory",
        "command": " ".join(shlex.quote(a) for a in [".venv/bin/python", *sys.argv]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
        },
        "runs": rows,
    }
    if len(rows) >= 2:
        extra = rows[1]["stages"] - rows[0]["stages"]
        diff = snaps[1].compare_to(snaps[0], "lineno")
        result["per_stage"] = {
            "stages_added": extra,
            "rss_bytes": round((rows[1]["rss_mib"] - rows[0]["rss_mib"]) * 2**20 / extra),
            "traced_bytes": round((rows[1]["traced_mib"] - rows[0]["traced_mib"]) * 2**20 / extra),
            "by_site": {_site(d): round(d.size_diff / extra) for d in diff[: args.top]},
        }
        print(json.dumps(result["per_stage"], indent=1), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
