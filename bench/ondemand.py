"""Traffic-driven hand-overs on the local control plane: held requests, swaps, residency, idle.

Starts the local control plane, one localnode node with one simulated GPU, the real operator and
two tiny AR stages of one group, both ``activation.policy: OnDemand`` and each declaring
``vram.request: 600k`` on a 1.1 MB GPU, so the operator never lets both be awake. Then:

1. swaps: ``--clients`` concurrent clients, each alternating its requests between the two
   stages (OpenAI ``/v1/completions`` on each worker's HTTP port), with ``minResidency: 0s``,
   until the operator counted ``--swaps`` demand-driven hand-overs (or ``--max-seconds``).
   Every answer must be 200 or a 503 of its own hold timeout; the added latency of a held
   request is the worker's ``x-omnistage-held-ms``; the hand-over time is the operator's own
   (its log line per hand-over: first sleep order to last wake ACK);
2. residency: the same traffic for ``--residency-seconds`` with ``minResidency`` set to
   ``--min-residency``: at most one swap per minResidency;
3. idle: ``idleAfter`` set to ``--idle-after``, traffic stopped: the awake stage must be
   asleep (its worker's own state) within idleAfter + 2 s of its last answer.

It writes bench/results/ondemand.json with the exact command, the machine and the date.

    .venv/bin/python bench/ondemand.py [--swaps 1000] [--clients 32] [--out PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import shlex
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from omnistage_operator.k8s.kube import OMNISTAGE, PODS, Kube  # noqa: E402
from tests.cluster.controlplane import ControlPlane  # noqa: E402
from tests.cluster.localnode import LocalNodes  # noqa: E402
from tests.e2e.conftest import (  # noqa: E402
    CAPACITY,
    OperatorProcess,
    stage_manifest,
)
from tests.worker.tiny_models import build_causal_lm  # noqa: E402

STAGES = ("a", "b")
HOLD_TIMEOUT = "30s"
_HANDOVER = re.compile(r"hand-over \S+: slept \[(.*?)\], woke \[(.*?)\] in ([0-9.]+)s")


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def _dist(values: list[float]) -> dict[str, float | int]:
    return {
        "n": len(values),
        "p50": round(_pct(values, 0.5), 1),
        "p95": round(_pct(values, 0.95), 1),
        "max": round(max(values), 1) if values else float("nan"),
    }


@dataclass
class Tally:
    """What the clients saw."""

    answers: Counter[str] = field(default_factory=Counter)
    held_ms: list[float] = field(default_factory=list)  # requests that were held
    errors: list[str] = field(default_factory=list)
    last_answer: dict[str, float] = field(default_factory=dict)  # stage: monotonic time


def _metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _scrape(op: OperatorProcess) -> str:
    url = f"http://127.0.0.1:{op.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as resp:
        return str(resp.read().decode())


def _handovers(op: OperatorProcess) -> list[tuple[str, str, float]]:
    """(slept, woke, seconds) of every hand-over the operator logged."""
    text = op.log.read_text(errors="replace") if op.log.exists() else ""
    return [(m.group(1), m.group(2), float(m.group(3))) for m in _HANDOVER.finditer(text)]


async def _client(
    i: int, http: httpx.AsyncClient, urls: dict[str, str], stop: asyncio.Event, tally: Tally
) -> None:
    n = i
    while not stop.is_set():
        stage = STAGES[n % 2]
        n += 1
        try:
            r = await http.post(
                f"{urls[stage]}/v1/completions",
                json={"prompt": f"client {i}", "max_tokens": 1},
            )
        except httpx.HTTPError as exc:
            tally.answers["transport-error"] += 1
            tally.errors.append(f"{stage}: {type(exc).__name__}: {exc}")
            continue
        if r.status_code == 200:
            tally.answers["ok"] += 1
            held = float(r.headers.get("x-omnistage-held-ms", "0"))
            if held > 1.0:
                tally.held_ms.append(held)
            tally.last_answer[stage] = time.monotonic()
        elif r.status_code == 503 and r.json()["error"]["code"] == "hold_timeout":
            tally.answers["hold-timeout"] += 1
        else:
            tally.answers[f"http-{r.status_code}"] += 1
            tally.errors.append(f"{stage}: {r.status_code} {r.text[:200]}")


async def _traffic(
    urls: dict[str, str],
    clients: int,
    until: Callable[[], Awaitable[bool]],
    max_seconds: float,
) -> tuple[Tally, float]:
    """Run the clients until ``until()`` is true or ``max_seconds``; (tally, seconds)."""
    tally = Tally()
    stop = asyncio.Event()
    limits = httpx.Limits(max_connections=clients * 2, max_keepalive_connections=clients * 2)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        tasks = [asyncio.create_task(_client(i, http, urls, stop, tally)) for i in range(clients)]
        started = time.monotonic()
        while time.monotonic() - started < max_seconds and not await until():  # noqa: ASYNC110
            await asyncio.sleep(1.0)  # the operator's counter is read once a second
        stop.set()
        await asyncio.gather(*tasks)
    return tally, time.monotonic() - started


async def _patch_activation(kube: Kube, ns: str, **fields: str) -> None:
    for name in STAGES:
        patch = {"spec": {"activation": {"policy": "OnDemand", **fields}}}
        await kube.merge_patch(OMNISTAGE, ns, name, patch)


async def _pod_urls(kube: Kube, ns: str) -> dict[str, str]:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        states = {n: ((await kube.get(OMNISTAGE, ns, n)) or {}).get("status") or {} for n in STAGES}
        if all(s.get("state") == "Asleep" for s in states.values()):
            urls = {}
            for name in STAGES:
                pod = await kube.get(PODS, ns, f"{name}-worker")
                assert pod is not None
                urls[name] = f"http://{pod['status']['podIP']}:8000"
            return urls
        await asyncio.sleep(0.5)
    raise TimeoutError("stages did not settle Asleep")


async def _health(http: httpx.AsyncClient, url: str) -> str:
    return str((await http.get(f"{url}/health")).json()["state"])


async def _run(
    args: argparse.Namespace, ns: str, op: OperatorProcess, kubeconfig: Path
) -> dict[str, Any]:
    os.environ["KUBECONFIG"] = str(kubeconfig)
    kube = await Kube.connect()
    urls = await _pod_urls(kube, ns)
    result: dict[str, Any] = {}

    # 1. forced swaps
    base_swaps = _metric(_scrape(op), "omnistage_demand_swaps_total")

    async def enough() -> bool:
        swaps = _metric(_scrape(op), "omnistage_demand_swaps_total") - base_swaps
        print(f"  swaps so far: {swaps:.0f}", flush=True)
        return bool(swaps >= args.swaps)

    before = len(_handovers(op))
    tally, seconds = await _traffic(urls, args.clients, enough, args.max_seconds)
    metrics = _scrape(op)
    swaps = _metric(metrics, "omnistage_demand_swaps_total") - base_swaps
    handovers = [h for h in _handovers(op)[before:] if h[0] and h[1]]
    handover_ms = [h[2] * 1000 for h in handovers]
    lost = sum(v for k, v in tally.answers.items() if k not in ("ok", "hold-timeout"))
    result["swaps"] = {
        "clients": args.clients,
        "seconds": round(seconds, 1),
        "demand_swaps": int(swaps),
        "swaps_per_second": round(swaps / seconds, 2) if seconds else 0,
        "answers": dict(tally.answers),
        "lost_or_failed": lost,
        "errors_sample": tally.errors[:10],
        "held_added_latency_ms": _dist(tally.held_ms),
        "handover_ms": _dist(handover_ms),
        "goal": "held p95 <= hand-over p95 + 100 ms",
        "held_p95_minus_handover_p95_ms": round(
            _pct(tally.held_ms, 0.95) - _pct(handover_ms, 0.95), 1
        ),
        "operator_hold_seconds_total": round(_metric(metrics, "omnistage_hold_seconds_total"), 3),
        "operator_held_served_total": int(_metric(metrics, "omnistage_held_requests_served_total")),
        "operator_held_timed_out_total": int(
            _metric(metrics, "omnistage_held_requests_timed_out_total")
        ),
    }
    print(json.dumps(result["swaps"], indent=2), flush=True)

    # 2. adversarial alternation under minResidency
    await _patch_activation(
        kube, ns, minResidency=f"{args.min_residency:g}s", holdTimeout=HOLD_TIMEOUT
    )
    await asyncio.sleep(2.0)  # the spec change reaches the operator
    base = _metric(_scrape(op), "omnistage_demand_swaps_total")

    async def never() -> bool:
        return False

    tally, seconds = await _traffic(urls, args.clients, never, args.residency_seconds)
    swaps = _metric(_scrape(op), "omnistage_demand_swaps_total") - base
    allowed = int(seconds // args.min_residency) + 1
    result["residency"] = {
        "min_residency_s": args.min_residency,
        "seconds": round(seconds, 1),
        "demand_swaps": int(swaps),
        "allowed_at_most": allowed,
        "ok": swaps <= allowed,
        "answers": dict(tally.answers),
        "held_added_latency_ms": _dist(tally.held_ms),
    }
    print(json.dumps(result["residency"], indent=2), flush=True)

    # 3. idle sleep
    await _patch_activation(
        kube,
        ns,
        minResidency=f"{args.min_residency:g}s",
        holdTimeout=HOLD_TIMEOUT,
        idleAfter=f"{args.idle_after:g}s",
    )
    await asyncio.sleep(2.0)
    async with httpx.AsyncClient(timeout=60) as http:
        r = await http.post(f"{urls['a']}/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 200, r.text
        last = time.monotonic()
        asleep_after = None
        while time.monotonic() - last < args.idle_after + 30:
            if await _health(http, urls["a"]) == "WORKER_STATE_ASLEEP":
                asleep_after = time.monotonic() - last
                break
            await asyncio.sleep(0.05)
    result["idle"] = {
        "idle_after_s": args.idle_after,
        "asleep_after_s": round(asleep_after, 2) if asleep_after is not None else None,
        "ok": asleep_after is not None and asleep_after <= args.idle_after + 2,
    }
    print(json.dumps(result["idle"], indent=2), flush=True)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--swaps", type=int, default=1000)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--max-seconds", type=float, default=1500.0)
    p.add_argument("--min-residency", type=float, default=2.0)
    p.add_argument("--residency-seconds", type=float, default=30.0)
    p.add_argument("--idle-after", type=float, default=3.0)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "ondemand.json")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ondemand-"))
    models = {"ar": build_causal_lm(work / "ar")}
    with ControlPlane() as cp:
        cp.kubectl("apply", "--server-side", "-f", str(ROOT / "crds/omnistages.omnistage.io.yaml"))
        cp.wait_crd_established("omnistages.omnistage.io")
        ns = cp.create_namespace("bench")
        with LocalNodes(cp.kubeconfig, nodes=1, gpus=1, gpu_memory=CAPACITY,
                        name_prefix="bench-") as nodes:  # fmt: skip
            node = nodes.node_names[0]
            op = OperatorProcess(cp, ns, work)
            op.start()
            try:
                for name in STAGES:
                    manifest = stage_manifest(
                        name, "ar", models, node, state="Asleep", vram_request="600k"
                    )
                    manifest["spec"]["activation"] = {
                        "policy": "OnDemand",
                        "minResidency": "0s",
                        "holdTimeout": HOLD_TIMEOUT,
                    }
                    cp.apply(manifest, namespace=ns)
                result = asyncio.run(_run(args, ns, op, cp.kubeconfig))
            finally:
                op.stop()
                if os.environ.get("BENCH_DEBUG"):
                    print(op.tail(200))
    summary = {
        "benchmark": "ondemand",
        "command": " ".join(shlex.quote(a) for a in [".venv/bin/python", *sys.argv]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "note": (
                "shared 2-core machine (other sessions running); control plane, localnode, "
                "operator, 2 workers and the clients all local"
            ),
        },
        **result,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
