"""What a pod's runner tells the API server: kubelet-style Events, and the pod's status written
in the background whenever it changed (``_mark``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import Any

from tests.cluster.localnode.api import Api, ApiError, Obj
from tests.cluster.localnode.devices import NodeSpec
from tests.cluster.localnode.events import pod_event
from tests.cluster.localnode.podstatus import (
    ContainerStatus,
    now_rfc3339,
    pod_conditions,
    pod_phase,
)

log = logging.getLogger("localnode.pod")


class PodReporting:
    """A pod's state as its runner keeps it (:class:`.runtime.PodRunner` sets every attribute),
    and its Events and status writes."""

    api: Api
    pod: Obj
    node: NodeSpec
    pod_ip: str
    uid: str
    ns: str
    name: str
    dir: Path
    init_done: bool
    init_failed: bool
    init_statuses: list[ContainerStatus]
    statuses: list[ContainerStatus]
    _dirty: asyncio.Event
    _status_written: asyncio.Event
    _start_time: str
    _event_tasks: set[asyncio.Task[None]]

    @property
    def label(self) -> str:
        """``namespace/name`` for logs."""
        return f"{self.ns}/{self.name}"

    def _log_path(self, container: str) -> Path:
        return self.dir / f"{container}.log"

    def event(
        self, reason: str, message: str, *, warning: bool = False, container: str = ""
    ) -> None:
        """Record a kubelet-style Event on the pod (best effort, in the background)."""
        body = pod_event(
            self.pod,
            self.node.name,
            reason,
            message,
            now_rfc3339(),
            warning=warning,
            container=container,
        )
        task = asyncio.create_task(self._post_event(body))
        self._event_tasks.add(task)
        task.add_done_callback(self._event_tasks.discard)

    def _warn(self, container: str, reason: str, message: str) -> None:
        self.event(reason, message, warning=True, container=container)

    async def _post_event(self, body: Obj) -> None:
        with contextlib.suppress(Exception):
            await self.api.create(f"/api/v1/namespaces/{self.ns}/events", body)

    def _mark(self) -> None:
        self._status_written.clear()
        self._dirty.set()

    async def _flush_status(self) -> None:
        self._mark()
        await self._status_written.wait()

    async def _status_writer(self) -> None:
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            try:
                await self._write_status()
            except ApiError as exc:
                if exc.status == 404:
                    self._status_written.set()
                    return
                log.warning("pod %s: status update failed: %s", self.label, exc)
                await asyncio.sleep(0.5)
                self._dirty.set()
                continue
            except Exception as exc:
                log.warning("pod %s: status update failed: %s", self.label, exc)
                await asyncio.sleep(0.5)
                self._dirty.set()
                continue
            if not self._dirty.is_set():
                self._status_written.set()
            await asyncio.sleep(0.05)

    async def _write_status(self) -> None:
        now = now_rfc3339()
        previous = (self.pod.get("status") or {}).get("conditions") or []
        gates = [g["conditionType"] for g in self.pod["spec"].get("readinessGates") or []]
        status: dict[str, Any] = {
            "phase": pod_phase(self.init_done, self.init_failed, self.statuses),
            "podIP": self.pod_ip,
            "podIPs": [{"ip": self.pod_ip}],
            "hostIP": self.node.address,
            "hostIPs": [{"ip": self.node.address}],
            "startTime": self._start_time,
            "conditions": pod_conditions(previous, self.init_done, self.statuses, gates, now),
            "containerStatuses": [s.render() for s in self.statuses],
        }
        if self.init_statuses:
            status["initContainerStatuses"] = [s.render() for s in self.init_statuses]
        updated = await self.api.patch(
            f"/api/v1/namespaces/{self.ns}/pods/{self.name}/status",
            {"status": status},
            patch="strategic",
        )
        if updated.get("metadata", {}).get("uid") == self.uid:
            self.pod = {**self.pod, "status": updated.get("status", {})}
