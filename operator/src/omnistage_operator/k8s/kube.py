"""The operator's Kubernetes client: kr8s objects (``Pod``, ``Service``, ``Secret``, the
``OmniStage`` and DRA classes), with the races of a controller made explicit.

404 reads as ``None`` and 409 on create as "already there"; ``delete_confirmed`` is the one
delete-and-wait-until-gone (fences, replacements, cleanup). Two things kr8s does not do are kept
here: a delete with a uid precondition (a fence never deletes a replacement pod), and Events
posted from outside kopf's handlers (the leader election's, before kopf runs), which kopf's
``kopf.event`` cannot post. Every call of a round is counted (``tallied``) for its metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

import kr8s
import kr8s.asyncio
from kr8s.asyncio.objects import APIObject, Event, Pod, Secret, Service, new_class

from omnistage_operator.decisions.event_series import EventSeries
from omnistage_operator.k8s import aio_lane, metrics
from omnistage_operator.k8s.api_session import (
    API_CONCURRENCY,
    EVENT_CONCURRENCY,
    KEEP_CONNECTIONS,
    KEEP_IDLE_S,
    keep_connections,
)

__all__ = [
    "API_CONCURRENCY",
    "CLAIMS",
    "EVENT_CONCURRENCY",
    "KEEP_CONNECTIONS",
    "KEEP_IDLE_S",
    "OMNISTAGE",
    "PODS",
    "RESOURCE_SLICES",
    "SECRETS",
    "SERVICES",
    "Kind",
    "Kube",
    "KubeError",
    "OmniStage",
    "ResourceClaim",
    "ResourceSlice",
    "Tally",
    "tallied",
    "tally_context",
]

log = logging.getLogger(__name__)

Kind = type[APIObject]
OmniStage: Kind = new_class("OmniStage", "omnistage.io/v1alpha1", namespaced=True)
ResourceClaim: Kind = new_class("ResourceClaim", "resource.k8s.io/v1", namespaced=True)
ResourceSlice: Kind = new_class("ResourceSlice", "resource.k8s.io/v1", namespaced=False)
_ABSENT = frozenset({404})  # a read or patch of what is not there: None
_EXISTS = frozenset({409})  # a create of what is there already: None
_GONE = frozenset({404, 409})  # a delete of what is gone, or was replaced (uid precondition)
# The names the callers use.
OMNISTAGE, PODS, SERVICES, SECRETS = OmniStage, Pod, Service, Secret
CLAIMS, RESOURCE_SLICES = ResourceClaim, ResourceSlice


def _clip(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` UTF-8 bytes (the API counts bytes), on a character."""
    data = text.encode()
    if len(data) <= limit:
        return text
    return data[: limit - 3].decode(errors="ignore") + "..."


@dataclass
class Tally:
    """API requests made, and the objects the reads among them returned (GET: one, LIST: its
    items); ``sink`` hears each request as it ends (requests, objects), a request of a task
    that outlives the context (an Event posted last) included."""

    requests: int = 0
    objects: int = 0
    sink: Callable[[int, int], None] | None = None

    def count(self, body: Any, *, read: bool) -> None:
        objects = 0
        if read:
            items = body.get("items") if isinstance(body, Mapping) else None
            objects = len(items) if isinstance(items, list) else int(body is not None)
        self.requests += 1
        self.objects += objects
        if self.sink is not None:
            self.sink(1, objects)


_TALLY: ContextVar[Tally | None] = ContextVar("omnistage_api_tally", default=None)


@contextlib.contextmanager
def tallied(sink: Callable[[int, int], None] | None = None) -> Iterator[Tally]:
    """Count the API requests of this context (and the tasks it starts) into a ``Tally``."""
    tally = Tally(sink=sink)
    token = _TALLY.set(tally)
    try:
        yield tally
    finally:
        _TALLY.reset(token)


def tally_context() -> contextvars.Context:
    """A context that carries only this one's ``Tally`` (for a request made later, on its
    behalf: a held Event; nothing else of this context is kept alive by it)."""
    out = contextvars.Context()
    out.run(_TALLY.set, _TALLY.get())
    return out


class KubeError(Exception):
    """An API call failed with a status other than the ones the caller handles."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class Kube:
    """Namespaced CRUD, as kr8s objects, on the few kinds the operator touches."""

    def __init__(self, api: Any, events: EventSeries | None = None) -> None:
        self.api = api
        # Repeats of an Event update it (count) instead of adding one (event_series).
        self.events = events if events is not None else EventSeries()
        self._slots = asyncio.Semaphore(API_CONCURRENCY)
        self._event_slots = asyncio.Semaphore(EVENT_CONCURRENCY)
        self.lane: aio_lane.AioLane | None = None  # ``connect``'s: requests over aiohttp
        self._closing: set[asyncio.Task[None]] = set()

    def set_lane(self, lane: aio_lane.AioLane | None) -> None:
        """Send requests through ``lane`` from now on (the one before is closed)."""
        old, self.lane = self.lane, lane
        if old is not None:
            task = asyncio.create_task(old.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        """Close the aiohttp lane (kr8s's client is kr8s's)."""
        self.set_lane(None)
        await asyncio.gather(*self._closing)

    @classmethod
    async def connect(cls) -> Kube:
        """Connect with the in-cluster service account or $KUBECONFIG."""
        api = await kr8s.asyncio.api()
        kube = cls(api)
        await keep_connections(api, kube.set_lane)
        return kube

    async def _call(
        self,
        kind: Kind,
        method: str,
        url: str,
        *,
        namespace: str | None,
        absent: frozenset[int],
        what: str,
        read: bool = False,
        answer: bool = True,
        **request: Any,
    ) -> dict[str, Any] | None:
        """One request (at most ``API_CONCURRENCY`` at once, ``_send``); the object
        the API answered with as plain JSON (None on a status in ``absent``; ``{}`` when the
        caller wants no ``answer``: it is read, not decoded).

        The answer is not wrapped in a kr8s object: turning each answer into a ``Box`` and back
        cost more CPU than the rest of a hand-over (py-spy over ``bench/operator_switch.py``)."""
        queued = time.monotonic()
        async with self._slots:
            sent = time.monotonic()
            lane = "event" if kind is Event else "request"
            metrics.API_WAIT_SECONDS.labels(lane).observe(sent - queued)
            try:
                code, body, message = await self._send(
                    kind, method, url, namespace=namespace, answer=answer, request=request
                )
            finally:
                metrics.API_REQUEST_SECONDS.labels(method).observe(time.monotonic() - sent)
        self._count(body, read=read)
        if body is not None:
            return body
        if code in absent:
            return None
        raise KubeError(f"{what}: HTTP {code}: {message}", code)

    async def _send(
        self, kind: Kind, method: str, url: str, *, namespace: str | None, answer: bool,
        request: dict[str, Any],
    ) -> tuple[int, dict[str, Any] | None, str]:  # fmt: skip
        """(status, the answer: None on an error status, the error's message): through the
        aiohttp lane when there is one (``aio_lane``), else (or when it cannot answer: a
        connection error, credentials refused) through kr8s's client, which re-authenticates."""
        ns = namespace if kind.namespaced else None
        if self.lane is not None:
            path = self.api._construct_url(kind.version, namespace=ns, url=url)
            try:
                code, raw = await self.lane.request(
                    method, path, read=answer, **aio_lane.lane_args(request)
                )
            except aio_lane.LaneFailed as exc:
                log.debug("%s %s through kr8s: %s", method, path, exc)
            else:
                if code >= 400:
                    return code, None, aio_lane.error_message(raw)
                return code, json.loads(raw) if answer and raw else {}, ""
        try:
            async with self.api.call_api(
                method, version=kind.version, url=url, namespace=ns, **request
            ) as resp:
                return resp.status_code, resp.json() if answer and resp.content else {}, ""
        except kr8s.ServerError as exc:
            code = exc.response.status_code if exc.response is not None else 0
            status: Mapping[str, Any] = exc.status if isinstance(exc.status, Mapping) else {}
            return code, None, str(status.get("message", exc))

    @staticmethod
    def _count(body: Any, *, read: bool = False) -> None:
        tally = _TALLY.get()
        if tally is not None:
            tally.count(body, read=read)

    async def get(self, kind: Kind, namespace: str, name: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        url = f"{kind.endpoint}/{name}"
        what = f"get {kind.kind}/{name}"
        return await self._call(
            kind, "GET", url, namespace=namespace, absent=_ABSENT, what=what, read=True
        )

    async def list_cluster(
        self, kind: Kind, field_selector: str | None = None
    ) -> list[dict[str, Any]]:
        """Items of a cluster-scoped list (``fieldSelector`` optional), as plain JSON."""
        params = {"fieldSelector": field_selector} if field_selector else {}
        body = await self._call(
            kind, "GET", kind.endpoint, namespace=None, absent=frozenset(),
            what=f"list {kind.kind}", read=True, params=params,
        )  # fmt: skip
        return list((body or {}).get("items") or [])

    async def create(self, kind: Kind, namespace: str, obj: Mapping[str, Any]) -> bool:
        """Create; False when it already exists (409)."""
        return await self.create_returning(kind, namespace, obj) is not None

    async def create_returning(
        self, kind: Kind, namespace: str, obj: Mapping[str, Any]
    ) -> dict[str, Any] | None:
        """Create and return the stored object; None when it already exists."""
        raw = {**obj, "metadata": {**obj["metadata"], "namespace": namespace}}
        raw.setdefault("apiVersion", kind.version)
        raw.setdefault("kind", kind.kind)
        what = f"create {kind.kind}/{obj['metadata'].get('name')}"
        return await self._call(
            kind, "POST", kind.endpoint, namespace=namespace, absent=_EXISTS, what=what, json=raw
        )

    async def delete(
        self,
        kind: Kind,
        namespace: str,
        name: str,
        *,
        uid: str | None = None,
        grace_s: int | None = None,
    ) -> bool:
        """Delete (background propagation); False when already gone (404, or another uid).

        Sent through the object's endpoint by hand: kr8s's ``delete`` has no uid precondition,
        and a fence must never delete the pod that replaced the one it fenced."""
        opts: dict[str, Any] = {"propagationPolicy": "Background"}
        if uid:
            opts["preconditions"] = {"uid": uid}
        if grace_s is not None:
            opts["gracePeriodSeconds"] = grace_s
        what = f"delete {kind.kind}/{name}"
        url = f"{kind.endpoint}/{name}"
        gone = await self._call(
            kind, "DELETE", url, namespace=namespace, absent=_GONE, what=what, json=opts
        )
        return gone is not None

    async def merge_patch(
        self,
        kind: Kind,
        namespace: str,
        name: str,
        patch: Mapping[str, Any],
        *,
        status: bool = False,
        answer: bool = True,
    ) -> dict[str, Any] | None:
        """JSON merge patch (of the status subresource when ``status``); None when gone.
        ``answer=False``: ``{}`` in place of the patched object, which is not decoded (a
        stage's whole body; a storm's status writes decoded and dropped one each, py-spy)."""
        url = f"{kind.endpoint}/{name}" + ("/status" if status else "")
        return await self._call(
            kind,
            "PATCH",
            url,
            namespace=namespace,
            absent=_ABSENT,
            what=f"patch {kind.kind}/{name}",
            answer=answer,
            content=json.dumps(patch),
            headers={"Content-Type": "application/merge-patch+json"},
        )

    async def wait_gone(
        self, kind: Kind, namespace: str, name: str, uid: str, timeout_s: float
    ) -> bool:
        """Poll until the object with ``uid`` is gone (404 or replaced); False on timeout."""
        deadline = time.monotonic() + timeout_s
        delay = 0.05
        while True:
            obj = await self.get(kind, namespace, name)
            if obj is None or obj["metadata"].get("uid") != uid:
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, 1.0)

    async def delete_confirmed(
        self,
        kind: Kind,
        namespace: str,
        name: str,
        uid: str,
        *,
        timeout_s: float,
        grace_s: int | None = None,
    ) -> bool:
        """Delete the object with ``uid`` and wait until the API confirms it gone (the one
        delete-and-confirm of fences, replacements and cleanup); False on timeout."""
        await self.delete(kind, namespace, name, uid=uid, grace_s=grace_s)
        return await self.wait_gone(kind, namespace, name, uid, timeout_s)

    async def event(
        self,
        involved: Mapping[str, Any],
        *,
        reason: str,
        message: str,
        warning: bool = False,
    ) -> None:
        """Record a core/v1 Event on ``involved`` (a body with apiVersion, kind, metadata); a
        repeat within the aggregation window updates an Event instead (``event_series``). At
        most ``EVENT_CONCURRENCY`` are recorded at once; the others wait their turn."""
        async with self._event_slots:
            await self._event(involved, reason=reason, message=message, warning=warning)

    async def _event(
        self, involved: Mapping[str, Any], *, reason: str, message: str, warning: bool
    ) -> None:
        meta = involved["metadata"]
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        kind = "Warning" if warning else "Normal"
        key = (meta["namespace"], meta.get("uid") or meta["name"], kind, reason)
        decision = self.events.decide(key, _clip(message, 1000))
        message = _clip(decision.message, 1000)
        if decision.name is not None:
            patch = {"count": decision.count, "lastTimestamp": now[:19] + "Z", "message": message}
            try:
                if await self.merge_patch(Event, meta["namespace"], decision.name, patch):
                    self.events.recorded(decision, decision.name)
                    return
                self.events.forget(decision)  # expired: record it anew
                decision = replace(decision, name=None, count=1)
            except KubeError as exc:
                log.warning("event %s on %s not updated: %s", reason, meta["name"], exc)
                return
        ev = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": involved.get("apiVersion"),
                "kind": involved.get("kind"),
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta.get("uid"),
            },
            "reason": reason,
            "message": message,
            "type": kind,
            "source": {"component": "omnistage-operator"},
            "reportingComponent": "omnistage-operator",
            "reportingInstance": "omnistage-operator",
            "firstTimestamp": now[:19] + "Z",
            "lastTimestamp": now[:19] + "Z",
            "eventTime": now,
            "action": reason,
            "count": 1,
        }
        try:
            created = await self.create_returning(Event, meta["namespace"], ev)
        except KubeError as exc:  # events are best effort
            log.warning("event %s on %s not recorded: %s", reason, meta["name"], exc)
            return
        if created is not None:
            self.events.recorded(decision, created["metadata"]["name"])
