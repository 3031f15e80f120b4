"""The storms of bench/scale.py: every group at once, timed from the API server's side.

A group is two OnDemand stages ``g<i>-a`` and ``g<i>-b`` pinned to one node; one GPU holds only
one of them. :class:`Fleet` creates them, watches them (one watch over the namespace) and runs:

- ``ondemand``: a Generate request to every sleeping ``b`` at once (the workers hold them and
  tell the operator, which sleeps ``a`` and wakes ``b``); latency = the request's answer time;
- ``handover``: ``spec.state: Active`` patched on every ``a`` at once (the latest ask wins);
  latency = from just before the group's PATCH to its new stage Active seen by the watch.

Per group, overhead = latency - the sleep ACK's and the wake ACK's own durations (as measured
by the workers, read from ``status.lastAck``).

``patch_storm``, ``ondemand_storm`` and ``later_storms`` (the leader killed midway, one host in
ten stopped) run them and return their figures.
"""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from bench.scale_operators import NamedOperator
from bench.scale_report import percentiles
from omnistage.worker.v1 import inference_service_pb2, inference_service_pb2_grpc
from tests.cluster.controlplane import ControlPlane
from tests.cluster.localnode import LocalNodes
from tests.cluster.localnode.api import Api, ApiError

GROUP = "omnistage.io/v1alpha1"
PARALLEL = 32
# a stage that lost the memory: asleep, or asleep and still wanting it (spec Active)
ASLEEP = ("Asleep", "Waiting")  # API requests the bench itself keeps in flight


def stage(
    name: str, group: str, node: str, *, model_dir: str, state: str, env: dict[str, str]
) -> dict[str, Any]:
    """One simulated stage of ``group`` on ``node`` (OnDemand; its weights in ``env``)."""
    return {
        "apiVersion": GROUP,
        "kind": "OmniStage",
        "metadata": {"name": name},
        "spec": {
            "runner": "AR",
            "backend": "Transformers",
            "image": "omnistage/worker:sim",
            "model": {
                "path": "/models/m",
                "mountPath": "/models/m",
                "volume": {"hostPath": {"path": model_dir, "type": "Directory"}},
            },
            "state": state,
            "sleepLevel": 1,
            "colocation": {"group": group, "priority": 0},
            "gpus": 1,
            "activation": {"policy": "OnDemand"},
            "worker": {"device": "cpu"},
            "template": {
                "nodeSelector": {"kubernetes.io/hostname": node},
                "env": [{"name": k, "value": v} for k, v in env.items()],
            },
        },
    }


async def bounded(calls: list[Callable[[], Awaitable[Any]]], limit: int = PARALLEL) -> list[Any]:
    """Run ``calls`` with at most ``limit`` in flight; their results in order."""
    sem = asyncio.Semaphore(limit)

    async def one(call: Callable[[], Awaitable[Any]]) -> Any:
        async with sem:
            return await call()

    return list(await asyncio.gather(*(one(c) for c in calls)))


@dataclass
class Seen:
    """What the watch saw of one stage."""

    state: str | None = None
    active_at: dict[int, float] = field(default_factory=dict)  # storm number -> first Active
    status: dict[str, Any] = field(default_factory=dict)
    rv_seen: dict[str, float] = field(default_factory=dict)  # resourceVersion -> when seen


class Fleet:
    """The bench's stages and one watch over them: in one namespace, or (shards) group ``g<i>``
    in ``namespaces[i % len(namespaces)]``, watched cluster-wide (stage names stay unique)."""

    def __init__(self, api: Api, namespace: str | list[str], groups: int) -> None:
        self.api = api
        self.namespaces = [namespace] if isinstance(namespace, str) else list(namespace)
        self.ns = self.namespaces[0]
        self.groups = [f"g{i}" for i in range(groups)]
        self.ns_of = {
            g: self.namespaces[i % len(self.namespaces)] for i, g in enumerate(self.groups)
        }
        self.seen: dict[str, Seen] = {}
        self.storm = 0
        # per storm: the writes the watch saw, by stage role (a/b) and the status keys changed
        self.writes: dict[int, Counter[str]] = {}
        self._watch: asyncio.Task[None] | None = None
        sharded = len(self.namespaces) > 1
        self.path = f"/apis/{GROUP}/" + ("" if sharded else f"namespaces/{self.ns}/") + "omnistages"

    def path_of(self, group: str) -> str:
        """The collection ``group``'s stages live in."""
        return f"/apis/{GROUP}/namespaces/{self.ns_of[group]}/omnistages"

    async def create(self, manifests: list[dict[str, Any]]) -> None:
        """Create each stage in its group's namespace."""
        calls: list[Callable[[], Awaitable[Any]]] = [
            functools.partial(self.api.create, self.path_of(m["spec"]["colocation"]["group"]), m)
            for m in manifests
        ]
        await bounded(calls)

    def start_watch(self) -> None:
        self._watch = asyncio.create_task(self._run_watch())

    async def stop_watch(self) -> None:
        if self._watch is not None:
            self._watch.cancel()

    async def _run_watch(self) -> None:
        while True:
            try:
                listing = await self.api.get(self.path)
                for obj in listing.get("items") or []:
                    self._note(obj)
                rv = listing["metadata"]["resourceVersion"]
                async for event in self.api.watch(self.path, {"resourceVersion": rv}, 600):
                    obj = event.get("object") or {}
                    if event.get("type") in ("ADDED", "MODIFIED"):
                        self._note(obj)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a closed watch is reopened, as a client would
                print(f"[scale] bench watch restarts: {exc}", flush=True)
                await asyncio.sleep(0.2)

    def _note(self, obj: dict[str, Any]) -> None:
        now = time.monotonic()
        name = obj["metadata"]["name"]
        seen = self.seen.setdefault(name, Seen())
        status = obj.get("status") or {}
        rv = obj["metadata"]["resourceVersion"]
        if seen.rv_seen and rv not in seen.rv_seen:
            tally = self.writes.setdefault(self.storm, Counter())
            tally[write_kind(name, seen.status, status)] += 1
        seen.status = status
        seen.state = seen.status.get("state")
        seen.rv_seen.setdefault(rv, now)
        if seen.state == "Active" and self.storm not in seen.active_at:
            seen.active_at[self.storm] = now

    def states(self, suffix: str) -> dict[str, str | None]:
        return {g: (self.seen.get(f"{g}-{suffix}") or Seen()).state for g in self.groups}

    async def settle(self, active: str, asleep: str, groups: list[str], within_s: float) -> float:
        """Wait until every group in ``groups`` has ``active`` Active and ``asleep`` asleep."""
        start = time.monotonic()
        while True:
            pending = [
                g
                for g in groups
                if (self.seen.get(f"{g}-{active}") or Seen()).state != "Active"
                or (self.seen.get(f"{g}-{asleep}") or Seen()).state not in ASLEEP
            ]
            if not pending:
                return time.monotonic() - start
            if time.monotonic() - start > within_s:
                raise TimeoutError(f"{len(pending)} group(s) not settled, e.g. {pending[:5]}")
            await asyncio.sleep(0.2)

    async def settle_both_asleep(self, groups: list[str], within_s: float) -> None:
        """Wait until both stages of every group in ``groups`` report Asleep."""
        start = time.monotonic()
        while True:
            pending = [
                g for g in groups
                if any((self.seen.get(f"{g}-{s}") or Seen()).state != "Asleep" for s in "ab")
            ]  # fmt: skip
            if not pending:
                return
            if time.monotonic() - start > within_s:
                raise TimeoutError(f"{len(pending)} group(s) not asleep, e.g. {pending[:5]}")
            await asyncio.sleep(0.5)

    async def patch_state(self, name: str, state: str) -> tuple[float, float, str]:
        """PATCH ``spec.state``: (monotonic before, after, the new resourceVersion)."""
        t0 = time.monotonic()
        body = {"spec": {"state": state}}
        for attempt in range(5):
            try:
                group = name.rsplit("-", 1)[0]
                obj = await self.api.patch(f"{self.path_of(group)}/{name}", body)
                return t0, time.monotonic(), str(obj["metadata"]["resourceVersion"])
            except ApiError:
                if attempt == 4:
                    raise
                await asyncio.sleep(0.5)
        raise AssertionError("unreachable")

    def overhead(self, gainer: str, loser: str, latency: float) -> float:
        """``latency`` less the two ACKs' own durations (wake of the gainer, sleep of the loser)."""
        wake = (self.seen.get(gainer) or Seen()).status.get("lastAck") or {}
        sleep = (self.seen.get(loser) or Seen()).status.get("lastAck") or {}
        worker = float(wake.get("durationSeconds") or 0) + float(sleep.get("durationSeconds") or 0)
        return latency - worker


def write_kind(name: str, before: dict[str, Any], after: dict[str, Any]) -> str:
    """One write of a stage as the watch saw it: its role (``a``/``b``) and the status keys it
    changed (``spec``: none, a write of the main resource), with the state change if any."""
    keys = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    role = name.rsplit("-", 1)[-1]
    state = ""
    if before.get("state") != after.get("state"):
        state = f" {before.get('state')}->{after.get('state')}"
    return f"{role}{state}: {','.join(keys) or 'spec'}"


def storm_writes(fleet: Fleet, storm: int, top: int = 12) -> dict[str, Any]:
    """The stage writes the bench's watch saw during ``storm``: how many, and the most common
    kinds (``write_kind``)."""
    tally = fleet.writes.get(storm, Counter())
    return {"total": sum(tally.values()), "kinds": dict(tally.most_common(top))}


async def generate(target: str, timeout_s: float) -> float:
    """One Generate to ``target``: the seconds until its answer (held while the stage wakes)."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = inference_service_pb2_grpc.InferenceServiceStub(channel)
        t0 = time.monotonic()
        await stub.Generate(
            inference_service_pb2.GenerateRequest(request_id="storm", prompt="hi"),
            timeout=timeout_s,
        )
        return time.monotonic() - t0


async def pod_targets(api: Api, namespace: str) -> dict[str, str]:
    """Each stage's worker address (``podIP:50051``) by stage name."""
    pods = await api.get(f"/api/v1/namespaces/{namespace}/pods")
    out = {}
    for pod in pods.get("items") or []:
        ip = (pod.get("status") or {}).get("podIP")
        stage_name = pod["metadata"]["name"].removesuffix("-worker")
        if ip:
            out[stage_name] = f"{ip}:50051"
    return out


async def patch_storm(
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
    latency, overhead, lag, done = [], [], [], []
    for g, (tp, tr, rv) in zip(groups, patches, strict=True):
        seen = fleet.seen[f"{g}-{gainer}"]
        lat = seen.active_at[n] - tp
        latency.append(lat)
        done.append(seen.active_at[n] - t0)
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
        **by_shard(fleet, groups, overhead, done),
    }


def by_shard(
    fleet: Fleet, groups: list[str], overhead: list[float], done: list[float]
) -> dict[str, Any]:
    """With several namespaces (shards): each one's groups, overhead percentiles and the time
    its last group was done (``done``: seconds from the storm's start, per group)."""
    if len(fleet.namespaces) < 2:
        return {}
    out: dict[str, Any] = {}
    for ns in fleet.namespaces:
        mine = [i for i, g in enumerate(groups) if fleet.ns_of[g] == ns]
        out[ns] = {
            "groups": len(mine),
            "overhead_s": percentiles([overhead[i] for i in mine]),
            "last_done_s": round(max((done[i] for i in mine), default=0.0), 2),
        }
    return {"by_shard": out}


async def fleet_targets(api: Api, fleet: Fleet) -> dict[str, str]:
    """Each stage's worker address over the fleet's namespaces."""
    out: dict[str, str] = {}
    for ns in fleet.namespaces:
        out.update(await pod_targets(api, ns))
    return out


async def ondemand_storm(fleet: Fleet, api: Api, groups: list[str]) -> dict[str, Any]:
    """A request to every group's sleeping ``b`` at once."""
    fleet.storm += 1
    targets = await fleet_targets(api, fleet)
    t0 = time.monotonic()

    async def one(g: str) -> float:
        answer = await generate(targets[f"{g}-b"], 600)
        done[g] = time.monotonic() - t0
        return answer

    done: dict[str, float] = {}
    answers = await asyncio.gather(*(one(g) for g in groups), return_exceptions=True)
    converge = time.monotonic() - t0
    await fleet.settle("b", "a", groups, 120)
    ok = [(g, a) for g, a in zip(groups, answers, strict=True) if isinstance(a, float)]
    failed = [repr(a) for a in answers if not isinstance(a, float)]
    overhead = [fleet.overhead(f"{g}-b", f"{g}-a", a) for g, a in ok]
    return {
        "groups": len(groups),
        "answered": len(ok),
        "failed": failed[:5],
        "converge_s": round(converge, 2),
        "latency_s": percentiles([a for _, a in ok]),
        "overhead_s": percentiles(overhead),
        **by_shard(fleet, [g for g, _ in ok], overhead, [done[g] for g, _ in ok]),
    }


async def kill_leader_midway(
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


async def later_storms(
    fleet: Fleet, ops: list[NamedOperator], cp: ControlPlane, nodes: LocalNodes, *,
    measured: Callable[[str, Awaitable[dict[str, Any]]], Awaitable[None]], out: dict[str, Any],
) -> None:  # fmt: skip
    """The leader killed mid-storm (or a second hand-over storm with one replica), then one
    simulated host in ten stopped during a hand-over storm of the others."""
    names = fleet.groups
    if len(ops) > 1:

        async def kill(f: Fleet, gainer: str, gs: list[str]) -> None:
            await kill_leader_midway(ops, cp, fleet.ns, fleet=f, gainer=gainer, groups=gs)

        await measured(
            "leader_kill", patch_storm(fleet, "b", "a", names, within_s=600, during=kill)
        )
    else:
        await measured("handover_again", patch_storm(fleet, "b", "a", names, within_s=600))
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
        await measured("unresponsive", patch_storm(fleet, "a", "b", live, within_s=600))
        out["unresponsive"]["frozen_groups"] = len(frozen)
        out["unresponsive"]["frozen_converged"] = sum(
            fleet.seen[f"{g}-a"].state == "Active" for g in frozen
        )
    finally:
        if frozen:
            os.kill(hosts[0]["pid"], signal.SIGCONT)
