"""Operator hand-over overhead on the local control plane.

Starts the local control plane, one localnode node with one fake GPU on which only one of two
tiny stages fits, and the real operator. Then it switches the awake stage N times by patching
``spec.state`` to Active on the sleeping one (the latest ask wins). For each switch:

    overhead = (status.state == Active seen by a watch) - (just before the PATCH request)
               - sleep ACK duration - wake ACK duration      (both measured by the workers)

It prints and writes p50/p95 to bench/results/operator_switch.json with the command, the
machine and the date, and a budget of the operator's path read from its log (millisecond
timestamps): ``front`` (PATCH -> the Sleep order), ``sleep`` (Sleep order -> WakeUp order: the
sleep RPC, the reading after it, the status checkpoint), ``wake`` (WakeUp order -> the round's
end), ``publish`` (the round's end -> Active seen by a watch); where the operator logs its
handler and the ACKs' arrival, also ``patch_to_handler`` (the API server and kopf),
``sleep_call`` and ``wake_call`` (the RPCs, the workers' transitions included) and ``own`` (the
operator's own work on the path: handler -> Sleep order, sleep ACK -> WakeUp order, wake ACK ->
the round's end). It also reads the operator
process's CPU time (``/proc``) over the switches: ``operator_cpu_ms_per_switch`` depends far
less on the machine's load than the wall times do; and the API server's own count of the
requests it answered over the switches (every client: the bench's patch and watch included) by
verb and resource (``apiserver_requests_per_switch``), with the API server's CPU time per switch
(``apiserver_cpu_ms_per_switch``). Targets (2-core machine): p50 <= 300 ms,
p95 <= 1 s.

    .venv/bin/python bench/operator_switch.py [--switches 20] [--out PATH]
        [--against REV [--blocks 2]]

``--against REV`` runs the operator of git revision REV (its ``operator/src``) and this tree's
in turns (``--blocks`` turns each, the switches split among them) on the same control plane
and workers, so both are measured under the same load, and reports their ratio.

``OPSWITCH_PROFILE=PATH`` runs the operator under cProfile and writes its stats to PATH (read
them with ``python -m pstats PATH``).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.scale_probe import Served  # noqa: E402
from omnistage_operator.k8s import kube as kube_module  # noqa: E402
from omnistage_operator.k8s.kube import OMNISTAGE, Kube  # noqa: E402
from tests.cluster.controlplane import ControlPlane  # noqa: E402
from tests.cluster.localnode import LocalNodes  # noqa: E402
from tests.e2e import conftest as e2e  # noqa: E402
from tests.e2e.conftest import CAPACITY, OperatorProcess, stage_manifest, wait_for  # noqa: E402
from tests.worker.tiny_models import build_causal_lm, build_diffusion_pipeline  # noqa: E402


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


async def _wait_active(kube: Kube, ns: str, name: str, since_rv: str, within_s: float) -> float:
    """Watch the stage until status.state is Active; return the monotonic time it was seen."""
    async with asyncio.timeout(within_s):
        async for kind, obj in kube.api.async_watch(
            OMNISTAGE, namespace=ns, field_selector=f"metadata.name={name}", since=since_rv
        ):
            status = obj.raw.get("status") or {}
            if os.environ.get("BENCH_DEBUG"):
                print("watch", kind, status.get("state"))
            if status.get("state") == "Active":
                return time.monotonic()
    raise TimeoutError(f"watch of {name} ended before Active")


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


_PROFILED = """\
import cProfile, runpy, sys, time
stats = sys.argv.pop()
profile = cProfile.Profile(time.process_time)  # CPU time: waits and preemption not counted
profile.enable()
try:
    runpy.run_module("omnistage_operator.cli", run_name="__main__")
except SystemExit:
    pass
finally:
    profile.disable()
    profile.dump_stats(stats)
"""


def _profiled_operator(work: Path, stats: Path) -> str:
    """A launcher that runs the operator under cProfile, timed in CPU time (same pid: ``exec``;
    the stats file goes last on the command line, taken off before the operator parses it)."""
    script = work / "profiled.py"
    script.write_text(_PROFILED)
    launcher = work / "operator-profiled"
    launcher.write_text(
        f"#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(str(script))}"
        f' "$@" {shlex.quote(str(stats))}\n'
    )
    launcher.chmod(0o755)
    return str(launcher)


def _acted(op: OperatorProcess) -> bool:
    """The operator leads and has run a round (the first switch pays no take-over)."""
    text = op.metrics()
    leading = any(line.startswith("omnistage_leader 1") for line in text.splitlines())
    return leading and "omnistage_rounds_total{" in text


def _round_requests(metrics_text: str, name: str = "omnistage_round_api_requests_total") -> float:
    """The operator's counter ``name`` (the rounds' API requests) summed over groups."""
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


KEPT = "omnistage_rounds_from_kept_readings_total"  # rounds whose Sleep needed no GetStatus


def _log_time(line: str) -> float | None:
    """Wall time of an operator log line (``YYYY-mm-dd HH:MM:SS,mmm LEVEL ...``, local time)."""
    try:
        stamp = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
    except ValueError:
        return None
    return stamp.timestamp()


# The operator's log lines that mark a hand-over's steps (the first of each in its window).
_MARKS = (
    ("asked", "omnistage_operator.runtime.handlers: "),  # the spec change reached the handler
    ("sleep", "omnistage_operator.decisions.handover.orders: sleep "),
    ("slept", "omnistage_operator.k8s.port: sleep "),  # its ACK arrived
    ("wake", "omnistage_operator.decisions.handover.orders: wake "),
    ("woken", "omnistage_operator.k8s.port: wake "),
    ("end", "hand-over "),
)


def _budget(log: Path, since: float, until: float) -> dict[str, float] | None:
    """The steps of one hand-over from the operator's log lines between two wall times:
    ``front``, ``sleep``, ``wake``, ``publish``, and where the operator logs them (its handler
    and the ACKs' arrival) their split into the API server's and the workers' calls and the
    operator's own work (``own``: handler to Sleep order, sleep ACK to WakeUp order, wake ACK
    to the round's end)."""
    marks: dict[str, float] = {}
    for line in log.read_text(errors="replace").splitlines():
        when = _log_time(line)
        if when is None or when < since - 0.002 or when > until + 0.002:
            continue
        for mark, text in _MARKS:
            if text in line and mark not in marks:
                if mark == "asked" and "spec.state" not in line:
                    continue
                marks[mark] = when
    if not {"sleep", "wake", "end"} <= set(marks):
        return None
    steps = {
        "front_s": marks["sleep"] - since,
        "sleep_s": marks["wake"] - marks["sleep"],
        "wake_s": marks["end"] - marks["wake"],
        "publish_s": until - marks["end"],
    }
    if {"asked", "slept", "woken"} <= set(marks):
        steps |= {
            "patch_to_handler_s": marks["asked"] - since,
            "sleep_call_s": marks["slept"] - marks["sleep"],
            "wake_call_s": marks["woken"] - marks["wake"],
            "own_s": (marks["sleep"] - marks["asked"]) + (marks["wake"] - marks["slept"])
            + (marks["end"] - marks["woken"]),
        }  # fmt: skip
    return steps


async def _switch(kube: Kube, ns: str, state: str) -> dict[str, float]:
    """Patch sd's wish; the stage that gains the memory is sd (Active) or ar (sd Asleep)."""
    gainer, loser = ("sd", "ar") if state == "Active" else ("ar", "sd")
    current = await kube.get(OMNISTAGE, ns, gainer)
    assert current is not None
    rv = current["metadata"]["resourceVersion"]
    waiter = asyncio.create_task(_wait_active(kube, ns, gainer, rv, 120))
    await asyncio.sleep(0.05)  # let the watch connect before the patch
    t0, w0 = time.monotonic(), time.time()
    await kube.merge_patch(OMNISTAGE, ns, "sd", {"spec": {"state": state}})
    t1 = await waiter
    w1 = time.time()
    gain = (await kube.get(OMNISTAGE, ns, gainer) or {}).get("status") or {}
    lose = (await kube.get(OMNISTAGE, ns, loser) or {}).get("status") or {}
    wake, sleep = gain.get("lastAck") or {}, lose.get("lastAck") or {}
    assert wake.get("op") == "wake" and wake.get("ok"), wake
    assert sleep.get("op") == "sleep" and sleep.get("ok"), sleep
    total = t1 - t0
    worker = float(wake["durationSeconds"]) + float(sleep["durationSeconds"])
    return {
        "total_s": total,
        "worker_s": worker,
        "overhead_s": total - worker,
        "wall_start": w0,
        "wall_end": w1,
    }


async def _settled(ns: str, kubeconfig: Path) -> None:
    """Wait until ar is Active and sd Asleep (the counters start from there: no setup in them)."""
    os.environ["KUBECONFIG"] = str(kubeconfig)
    kube = await Kube.connect()
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        a = (await kube.get(OMNISTAGE, ns, "ar") or {}).get("status") or {}
        b = (await kube.get(OMNISTAGE, ns, "sd") or {}).get("status") or {}
        if a.get("state") == "Active" and b.get("state") == "Asleep":
            break
        await asyncio.sleep(0.2)
    else:
        raise TimeoutError("stages did not settle")


async def _run(ns: str, switches: int, kubeconfig: Path, log: Path) -> list[dict[str, float]]:
    await _settled(ns, kubeconfig)
    kube = await Kube.connect()
    results = []
    for i in range(switches):
        # sd asks for Active (the latest ask wins over ar), then gives up its wish (ar, still
        # wanting Active, gets the memory back): one patch, one hand-over, each way.
        state = "Active" if i % 2 == 0 else "Asleep"
        to = "sd" if state == "Active" else "ar"
        r = await _switch(kube, ns, state)
        steps = _budget(log, r.pop("wall_start"), r.pop("wall_end"))
        r.update(steps or {})
        print(f"switch {i + 1:2d} -> {to}: total {r['total_s'] * 1000:7.1f} ms, "
              f"worker {r['worker_s'] * 1000:6.1f} ms, overhead {r['overhead_s'] * 1000:7.1f} ms",
              flush=True)  # fmt: skip
        results.append(r)
        await asyncio.sleep(0.3)  # let the loser's Waiting status settle
    return results


# The budget's steps (``_budget``), reported as p50 in ``budget_p50_ms``.
_STEPS = ("front", "sleep", "wake", "publish", "patch_to_handler", "sleep_call", "wake_call", "own")


def _figures(
    results: list[dict[str, float]],
    cpu_s: float,
    requests: float,
    kept: float,
    served: Served,
) -> dict[str, Any]:
    """Percentiles, the step budget, CPU and API requests per switch of one operator's runs."""
    overhead = [r["overhead_s"] for r in results]
    total = [r["total_s"] for r in results]
    n = max(len(results), 1)
    return {
        "switches": len(results),
        "overhead_ms": {
            "p50": round(_pct(overhead, 0.5) * 1000, 1),
            "p95": round(_pct(overhead, 0.95) * 1000, 1),
            "mean": round(statistics.mean(overhead) * 1000, 1),
            "max": round(max(overhead) * 1000, 1),
        },
        "patch_to_active_ms": {
            "p50": round(_pct(total, 0.5) * 1000, 1),
            "p95": round(_pct(total, 0.95) * 1000, 1),
        },
        "budget_p50_ms": {
            step: round(_pct([r[f"{step}_s"] for r in results if f"{step}_s" in r], 0.5) * 1000, 1)
            for step in _STEPS
            if any(f"{step}_s" in r for r in results)
        },
        # Load-independent: the rounds' API requests per hand-over (resyncs and Events included).
        "round_api_requests_per_switch": round(requests / n, 2),
        # Hand-overs whose first Sleep went out from the readings kept from the round before.
        "rounds_from_kept_readings_per_switch": round(kept / n, 2),
        # The operator process's CPU (kopf's event handling, rounds, status, Events; the 0.3 s
        # pause after each switch included) per switch.
        "operator_cpu_ms_per_switch": round(cpu_s * 1000 / n, 1),
        # The API server's own count (every client, the bench's patch and watch included), by
        # verb and resource, and its CPU (it serves the localnode and the Lease too).
        "apiserver_requests_per_switch": {
            k: round(v / n, 2) for k, v in sorted(served.requests.items()) if v > 0
        },
        "apiserver_cpu_ms_per_switch": round(served.cpu_s * 1000 / n, 1),
    }


def _operator_tree(work: Path, rev: str) -> Path:
    """``operator/src`` of git revision ``rev``, unpacked under ``work``."""
    dest = work / f"against-{rev}"
    dest.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, "operator/src"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest / "operator" / "src"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--switches", type=int, default=20)
    p.add_argument("--against", help="also run the operator of this git revision, in turns")
    p.add_argument("--blocks", type=int, default=2, help="turns of each operator (--against)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "operator_switch.json")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="opswitch-"))
    models = {"ar": build_causal_lm(work / "ar"), "sd": build_diffusion_pipeline(work / "sd")}
    profile = os.environ.get("OPSWITCH_PROFILE")
    if profile:
        e2e.OPERATOR = _profiled_operator(work, Path(profile).resolve())
    path = os.environ.get("PYTHONPATH", "")
    variants = {"current": path}
    if args.against:
        variants = {"against": f"{_operator_tree(work, args.against)}:{path}", **variants}
    blocks = args.blocks if args.against else 1
    per_block = max(2, args.switches // blocks // 2 * 2)  # even: each block ends as it began
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    cpu = dict.fromkeys(variants, 0.0)
    requests = dict.fromkeys(variants, 0.0)
    kept = dict.fromkeys(variants, 0.0)
    with ControlPlane() as cp:
        served = {name: Served(cp) for name in variants}
        cp.kubectl("apply", "--server-side", "-f", str(ROOT / "crds/omnistages.omnistage.io.yaml"))
        cp.wait_crd_established("omnistages.omnistage.io")
        ns = cp.create_namespace("bench")
        with LocalNodes(cp.kubeconfig, nodes=1, gpus=1, gpu_memory=CAPACITY,
                        name_prefix="bench-") as nodes:  # fmt: skip
            node = nodes.node_names[0]
            for block in range(blocks):
                for name, pythonpath in variants.items():
                    os.environ["PYTHONPATH"] = pythonpath
                    op = OperatorProcess(cp, ns, work)
                    op.start()
                    try:
                        if block == 0 and name == next(iter(variants)):
                            manifests = (("ar", "Active"), ("sd", "Asleep"))
                            for stage, state in manifests:
                                manifest = stage_manifest(stage, stage, models, node, state=state)
                                cp.apply(manifest, namespace=ns)
                        assert op.proc is not None
                        wait_for("operator leading", functools.partial(_acted, op), 120)
                        asyncio.run(_settled(ns, cp.kubeconfig))
                        seen = op.metrics()
                        requests_before = _round_requests(seen)
                        kept_before = _round_requests(seen, KEPT)
                        cpu_before = _cpu_s(op.proc.pid)
                        print(f"-- {name} operator, block {block + 1}", flush=True)
                        with served[name].window():
                            runs[name] += asyncio.run(_run(ns, per_block, cp.kubeconfig, op.log))
                        cpu[name] += _cpu_s(op.proc.pid) - cpu_before
                        seen = op.metrics()
                        requests[name] += _round_requests(seen) - requests_before
                        kept[name] += _round_requests(seen, KEPT) - kept_before
                    finally:
                        op.stop()
                        if os.environ.get("BENCH_DEBUG"):
                            print(op.tail(200))
            os.environ["PYTHONPATH"] = path
    figures = {
        name: _figures(runs[name], cpu[name], requests[name], kept[name], served[name])
        for name in variants
    }
    results = runs["current"]
    summary: dict[str, Any] = {
        "benchmark": "operator_switch",
        "command": " ".join(shlex.quote(a) for a in [".venv/bin/python", *sys.argv]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "load_avg_at_end": [round(x, 2) for x in os.getloadavg()],
            "note": "shared 2-core machine; control plane, localnode, operator and 2 workers local",
        },
        "operator_source": str(Path(kube_module.__file__).resolve().parents[1]),
        **figures["current"],
        "targets_ms": {"p50": 300, "p95": 1000},
        "runs_ms": [
            {k.removesuffix("_s"): round(v * 1000, 2) for k, v in r.items()} for r in results
        ],
    }
    if args.against:
        # Both operators in turns on the same control plane and workers, so under the same load.
        before = figures["against"]
        summary["against"] = {"rev": args.against, "blocks": blocks, **before}
        summary["current_over_against"] = {
            # The whole patch -> Active: on a starved machine, work moved beside a worker's
            # transition can lengthen the transition the overhead subtracts.
            "patch_to_active_p50": round(
                summary["patch_to_active_ms"]["p50"]
                / max(before["patch_to_active_ms"]["p50"], 1e-9),
                3,
            ),
            "overhead_p50": round(
                summary["overhead_ms"]["p50"] / max(before["overhead_ms"]["p50"], 1e-9), 3
            ),
            "operator_cpu_per_switch": round(
                summary["operator_cpu_ms_per_switch"]
                / max(before["operator_cpu_ms_per_switch"], 1e-9),
                3,
            ),
        }
    summary["meets_targets"] = (
        summary["overhead_ms"]["p50"] <= 300 and summary["overhead_ms"]["p95"] <= 1000
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    shown = (
        "overhead_ms", "patch_to_active_ms", "budget_p50_ms", "round_api_requests_per_switch",
        "rounds_from_kept_readings_per_switch", "operator_cpu_ms_per_switch",
        "apiserver_requests_per_switch", "apiserver_cpu_ms_per_switch", "against",
        "current_over_against",
    )  # fmt: skip
    print(json.dumps({k: summary[k] for k in shown if k in summary}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
