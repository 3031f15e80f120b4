"""The node agent: registers fake GPU nodes, keeps them Ready, runs the pods bound to them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

from tests.cluster.localnode.api import Api, ApiError, Obj
from tests.cluster.localnode.container_run import Backoff
from tests.cluster.localnode.devices import (
    NodeSpec,
    device_class,
    fake_gpu_dir,
    node_manifest,
    node_status,
    resource_slice,
)
from tests.cluster.localnode.podstatus import now_micro, now_rfc3339
from tests.cluster.localnode.runtime import PodRunner
from tests.cluster.localnode.simlaunch import SimHosts
from tests.fakegpu.device import FakeGpu

log = logging.getLogger("localnode")

HEARTBEAT_SECONDS = 10.0
STATUS_EVERY = 6  # heartbeats between node status posts (the lease is the heartbeat)
PARALLEL = 16  # node requests in flight at once (registration, heartbeats)
NOT_READY_TAINT = "node.kubernetes.io/not-ready"
KUBELET_FAULTS = "kubelet-faults.json"


def deletion_held(faults: object, namespace: str, name: str) -> bool:
    """Whether the kubelet-faults table holds the deletion of pod ``namespace/name``.

    ``{"hold_deletions": ["name", "namespace/name", ...]}``: a bare name matches any namespace.
    """
    held = faults.get("hold_deletions") if isinstance(faults, dict) else None
    return isinstance(held, list) and (name in held or f"{namespace}/{name}" in held)


class IpPool:
    """Pod IPs ``<prefix>.<2..254>`` handed out round-robin, so a freed one is reused late."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self._used: set[int] = set()
        self._next = 2

    def allocate(self) -> str:
        """A free address; RuntimeError when all 253 are in use."""
        for _ in range(253):
            host = self._next
            self._next = 2 if self._next >= 254 else self._next + 1
            if host not in self._used:
                self._used.add(host)
                return f"{self.prefix}.{host}"
        raise RuntimeError(f"no free pod IP left in {self.prefix}.0/24")

    def claim(self, ip: str) -> None:
        """Mark ``ip`` (already in this pool) as in use."""
        self._used.add(int(ip.rsplit(".", 1)[1]))

    def release(self, ip: str) -> None:
        """Return ``ip`` to the pool."""
        self._used.discard(int(ip.rsplit(".", 1)[1]))


class Kubelet:
    """Plays the kubelet (and a DRA driver's node side) for ``nodes``."""

    def __init__(
        self,
        api: Api,
        nodes: list[NodeSpec],
        state_dir: Path,
        backoff: Backoff,
        delete_nodes: bool,
        *,
        watch_timeout: int = 300,
        sim_hosts: int = 0,
    ):
        """``sim_hosts``: serve worker containers by that many simulated worker hosts
        (:mod:`.simlaunch`; 0: a process per container)."""
        self.watch_timeout = watch_timeout
        self.sim = SimHosts(state_dir, sim_hosts) if sim_hosts > 0 else None
        self.api = api
        self.nodes = {n.name: n for n in nodes}
        self.state_dir = state_dir
        self.backoff = backoff
        self.delete_nodes = delete_nodes
        self.runners: dict[str, PodRunner] = {}
        self.pools = {n.name: IpPool(n.address.rsplit(".", 1)[0]) for n in nodes}
        self._ips: dict[str, str] = {}
        self._since: dict[str, str] = {}
        self._stopping = False

    def create_fake_gpus(self) -> None:
        """Write each simulated device's ``device.json`` (its physics) under the state dir."""
        for node in self.nodes.values():
            if node.real:
                continue
            for dev in node.device_names():
                FakeGpu.create(fake_gpu_dir(self.state_dir, node.name, dev), node.fake_device(dev))

    def deletion_held(self, namespace: str, name: str) -> bool:
        """The kubelet fault ``hold_deletions``, read from the state dir on every check."""
        try:
            faults = json.loads((self.state_dir / KUBELET_FAULTS).read_text())
        except (OSError, ValueError):
            return False
        return deletion_held(faults, namespace, name)

    async def run(self, ready: asyncio.Event | None = None) -> None:
        """Register the nodes, then heartbeat and run pods until cancelled."""
        await asyncio.to_thread(self.create_fake_gpus)
        if self.sim is not None:
            await self.sim.start({n.name: n.index for n in self.nodes.values()})
        await self._ensure_device_class()
        await self._each_node(self._register)
        log.info("nodes registered: %d (%s..)", len(self.nodes), next(iter(self.nodes)))
        if ready is not None:
            ready.set()
        tasks = [asyncio.create_task(self._heartbeat()), asyncio.create_task(self._watch_pods())]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()

    async def shutdown(self) -> None:
        """Stop every pod process (short grace) and, if asked, delete the Nodes."""
        self._stopping = True
        runners = list(self.runners.values())
        for r in runners:
            r.pod["metadata"]["deletionGracePeriodSeconds"] = min(r._grace(), 3)
            r.terminate(delete_object=False, force=True)
        await asyncio.gather(*(r.wait() for r in runners), return_exceptions=True)
        if self.sim is not None:
            await self.sim.close()
        if self.delete_nodes:

            async def delete(node: NodeSpec) -> None:
                with contextlib.suppress(Exception):
                    await self.api.delete(f"/api/v1/nodes/{node.name}")
                    await self.api.delete(
                        "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/"
                        + node.name
                    )

            await self._each_node(delete)

    async def _each_node(self, call: Callable[[NodeSpec], Awaitable[None]]) -> None:
        """``call`` for every node, ``PARALLEL`` at a time (hundreds of nodes, one client)."""
        limit = asyncio.Semaphore(PARALLEL)

        async def one(node: NodeSpec) -> None:
            async with limit:
                await call(node)

        await asyncio.gather(*(one(n) for n in self.nodes.values()))

    # ---- nodes -----------------------------------------------------------------------------
    async def _ensure_device_class(self) -> None:
        try:
            await self.api.create("/apis/resource.k8s.io/v1/deviceclasses", device_class())
        except ApiError as exc:
            if exc.status != 409:
                raise

    async def _register(self, node: NodeSpec) -> None:
        manifest = node_manifest(node)
        existing = await self.api.get_or_none(f"/api/v1/nodes/{node.name}")
        if existing is None:
            existing = await self.api.create("/api/v1/nodes", manifest)
        else:
            existing = await self.api.patch(
                f"/api/v1/nodes/{node.name}",
                {"metadata": {"labels": manifest["metadata"]["labels"]}},
            )
        self._since[node.name] = now_rfc3339()
        await self._post_status(node)
        await self._renew_lease(node)
        # the kubelet leaves this to the node-lifecycle controller; doing it here saves seconds
        taints = [
            t
            for t in (existing.get("spec") or {}).get("taints") or []
            if t.get("key") != NOT_READY_TAINT
        ]
        await self.api.patch(f"/api/v1/nodes/{node.name}", {"spec": {"taints": taints or None}})
        await self._publish_slice(node, existing["metadata"]["uid"])

    async def _post_status(self, node: NodeSpec) -> None:
        status = node_status(node, now_rfc3339())
        for cond in status["conditions"]:
            cond["lastTransitionTime"] = self._since[node.name]
        await self.api.patch(f"/api/v1/nodes/{node.name}/status", {"status": status})

    async def _renew_lease(self, node: NodeSpec) -> None:
        path = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{node.name}"
        spec = {"holderIdentity": node.name, "leaseDurationSeconds": 40, "renewTime": now_micro()}
        try:
            await self.api.patch(path, {"spec": spec})
        except ApiError as exc:
            if exc.status != 404:
                raise
            body: Obj = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": node.name, "namespace": "kube-node-lease"},
                "spec": spec,
            }
            await self.api.create(
                "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases", body
            )

    async def _publish_slice(self, node: NodeSpec, node_uid: str) -> None:
        body = resource_slice(node, node_uid)
        path = f"/apis/resource.k8s.io/v1/resourceslices/{body['metadata']['name']}"
        existing = await self.api.get_or_none(path)
        if (
            existing is not None
            and existing["metadata"].get("ownerReferences", [{}])[0].get("uid") != node_uid
        ):
            await self.api.delete(path)
            existing = None
        if existing is None:
            await self.api.create("/apis/resource.k8s.io/v1/resourceslices", body)
        else:
            await self.api.patch(path, {"spec": body["spec"]})

    async def _heartbeat(self) -> None:
        """Renew every node's Lease each ``HEARTBEAT_SECONDS``; post its status every
        ``STATUS_EVERY`` beats (as the kubelet: the Lease is the heartbeat, the status is
        reported less often when nothing changes)."""
        beat = 0
        while True:
            await asyncio.sleep(HEARTBEAT_SECONDS)
            beat += 1
            with_status = beat % STATUS_EVERY == 0

            async def one(node: NodeSpec, with_status: bool = with_status) -> None:
                try:
                    await self._renew_lease(node)
                    if with_status:
                        await self._post_status(node)
                except Exception as exc:
                    log.warning("node %s heartbeat failed: %s", node.name, exc)

            await self._each_node(one)

    # ---- pods ------------------------------------------------------------------------------
    async def _watch_pods(self) -> None:
        """One list+watch of the bound pods for all nodes (a watch per node would hold a
        connection each: hundreds of nodes would exhaust the client's pool)."""
        selector = {"fieldSelector": "spec.nodeName!="}
        while True:
            try:
                listing = await self.api.get("/api/v1/pods", selector)
                seen = set()
                for pod in listing.get("items") or []:
                    seen.add(pod["metadata"]["uid"])
                    await self._dispatch("ADDED", pod)
                for uid, runner in list(self.runners.items()):
                    if uid not in seen:
                        runner.terminate(delete_object=False)
                rv = listing["metadata"]["resourceVersion"]
                while True:
                    log.info("pod watch (re)opened at resourceVersion %s", rv)
                    async for event in self.api.watch(
                        "/api/v1/pods", dict(selector, resourceVersion=rv), self.watch_timeout
                    ):
                        kind = event.get("type")
                        obj = event.get("object") or {}
                        if kind == "ERROR":
                            raise ApiError(
                                "WATCH",
                                "/api/v1/pods",
                                int(obj.get("code", 500)),
                                str(obj.get("message")),
                            )
                        rv = obj.get("metadata", {}).get("resourceVersion", rv)
                        if kind != "BOOKMARK":
                            await self._dispatch(str(kind), obj)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.info("pod watch restarts: %s", exc)
                await asyncio.sleep(0.5)

    async def _dispatch(self, kind: str, pod: Obj) -> None:
        """A pod event: handled when the pod is bound to one of this localnode's nodes."""
        node = self.nodes.get((pod.get("spec") or {}).get("nodeName") or "")
        if node is not None:
            await self._on_pod(node, kind, pod)

    async def _on_pod(self, node: NodeSpec, kind: str, pod: Obj) -> None:
        if self._stopping:
            return
        meta = pod["metadata"]
        uid = meta["uid"]
        runner = self.runners.get(uid)
        if kind == "DELETED":
            if runner is not None:
                runner.terminate(delete_object=False)
            return
        if runner is not None:
            runner.update(pod)
            return
        phase = (pod.get("status") or {}).get("phase")
        if meta.get("deletionTimestamp"):
            # nothing of it runs here: let it go now
            body = {
                "apiVersion": "v1",
                "kind": "DeleteOptions",
                "gracePeriodSeconds": 0,
                "preconditions": {"uid": uid},
            }
            with contextlib.suppress(ApiError):
                await self.api.delete(
                    f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}", body
                )
            return
        if phase in ("Succeeded", "Failed"):
            return
        ip = (pod.get("status") or {}).get("podIP") or ""
        pool = self.pools[node.name]
        if not ip.startswith(pool.prefix + ".") or ip in self._ips.values():
            ip = pool.allocate()
        else:
            pool.claim(ip)
        runner = PodRunner(
            self.api,
            pod,
            node,
            pod_ip=ip,
            state_dir=self.state_dir,
            backoff=self.backoff,
            on_done=self._done,
            deletion_held=self.deletion_held,
            sim=self.sim.host_for(node.index) if self.sim is not None else None,
        )
        self.runners[uid] = runner
        self._ips[uid] = ip
        log.info(
            "pod %s/%s bound to %s: starting with IP %s",
            meta["namespace"],
            meta["name"],
            node.name,
            ip,
        )
        runner.start()

    def _done(self, runner: PodRunner, gone: bool) -> None:
        """The pod's processes ended (free its IP); ``gone``: forget the runner too."""
        if gone:
            self.runners.pop(runner.uid, None)
        ip = self._ips.pop(runner.uid, None)
        if ip:
            self.pools[runner.node.name].release(ip)
