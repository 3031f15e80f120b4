"""A thin async Kubernetes client for the operator (kr8s's HTTP session underneath).

JSON in, JSON out; 404 reads as ``None`` and 409 on create as "already there", so callers handle
the races of a controller explicitly.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, cast

import kr8s
import kr8s.asyncio

__all__ = ["Kube", "KubeError", "Tally", "tallied"]

log = logging.getLogger(__name__)

OMNISTAGE = ("/apis", "omnistage.io/v1alpha1", "omnistages")
PODS = ("/api", "v1", "pods")
SERVICES = ("/api", "v1", "services")
SECRETS = ("/api", "v1", "secrets")
EVENTS = ("/api", "v1", "events")
CLAIMS = ("/apis", "resource.k8s.io/v1", "resourceclaims")
RESOURCE_SLICES = ("/apis", "resource.k8s.io/v1", "resourceslices")  # cluster-scoped

Resource = tuple[str, str, str]


def _clip(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` UTF-8 bytes (the API counts bytes), on a character."""
    data = text.encode()
    if len(data) <= limit:
        return text
    return data[: limit - 3].decode(errors="ignore") + "..."


@dataclass
class Tally:
    """API requests made, and objects they returned (the items of a list, else one)."""

    requests: int = 0
    objects: int = 0

    def count(self, body: Any) -> None:
        self.requests += 1
        items = body.get("items") if isinstance(body, Mapping) else None
        self.objects += len(items) if isinstance(items, list) else int(body is not None)


_TALLY: ContextVar[Tally | None] = ContextVar("omnistage_api_tally", default=None)


@contextlib.contextmanager
def tallied() -> Iterator[Tally]:
    """Count the API requests of this context (and the tasks it starts) into a ``Tally``."""
    tally = Tally()
    token = _TALLY.set(tally)
    try:
        yield tally
    finally:
        _TALLY.reset(token)


class KubeError(Exception):
    """An API call failed with a status other than the ones the caller handles."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class Kube:
    """Namespaced CRUD on the few resources the operator touches."""

    def __init__(self, api: Any) -> None:
        self._api = api

    @classmethod
    async def connect(cls) -> Kube:
        """Connect with the in-cluster service account or $KUBECONFIG."""
        return cls(await kr8s.asyncio.api())

    async def _call(
        self, method: str, res: Resource, namespace: str | None, url: str = "", **kw: Any
    ) -> tuple[int, Any]:
        base, version, plural = res
        path = plural + (f"/{url}" if url else "")
        try:
            async with self._api.call_api(
                method, version=version, base=base, namespace=namespace, url=path, **kw
            ) as resp:
                code, body = resp.status_code, (resp.json() if resp.content else None)
        except kr8s.ServerError as exc:
            code = exc.response.status_code if exc.response is not None else 0
            body = exc.status
        tally = _TALLY.get()
        if tally is not None:
            tally.count(body if code < 300 else None)
        return code, body

    @staticmethod
    def _raise(what: str, code: int, body: Any) -> None:
        msg = body.get("message", "") if isinstance(body, Mapping) else str(body)
        raise KubeError(f"{what}: HTTP {code}: {msg}", code)

    async def get(self, res: Resource, namespace: str, name: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        code, body = await self._call("GET", res, namespace, name)
        if code == 404:
            return None
        if code >= 300:
            self._raise(f"get {res[2]}/{name}", code, body)
        return cast(dict[str, Any], body)

    async def list_cluster(
        self, res: Resource, field_selector: str | None = None
    ) -> list[dict[str, Any]]:
        """Items of a cluster-scoped list (``fieldSelector`` optional)."""
        params = {"fieldSelector": field_selector} if field_selector else None
        code, body = await self._call("GET", res, None, params=params)
        if code >= 300:
            self._raise(f"list {res[2]}", code, body)
        return cast(list[dict[str, Any]], body.get("items", []))

    async def list(
        self, res: Resource, namespace: str, label_selector: str | None = None
    ) -> list[dict[str, Any]]:
        """Items of a namespaced list."""
        params = {"labelSelector": label_selector} if label_selector else None
        code, body = await self._call("GET", res, namespace, params=params)
        if code >= 300:
            self._raise(f"list {res[2]}", code, body)
        return cast(list[dict[str, Any]], body.get("items", []))

    async def create(self, res: Resource, namespace: str, obj: Mapping[str, Any]) -> bool:
        """Create; False when it already exists (409)."""
        code, body = await self._call("POST", res, namespace, json=dict(obj))
        if code == 409:
            return False
        if code >= 300:
            self._raise(f"create {res[2]}/{obj['metadata'].get('name')}", code, body)
        return True

    async def create_returning(
        self, res: Resource, namespace: str, obj: Mapping[str, Any]
    ) -> dict[str, Any] | None:
        """Create and return the stored object; None when it already exists."""
        code, body = await self._call("POST", res, namespace, json=dict(obj))
        if code == 409:
            return None
        if code >= 300:
            self._raise(f"create {res[2]}/{obj['metadata'].get('name')}", code, body)
        return cast(dict[str, Any], body)

    async def delete(
        self,
        res: Resource,
        namespace: str,
        name: str,
        *,
        uid: str | None = None,
        grace_s: int | None = None,
    ) -> bool:
        """Delete (background propagation); False when already gone (404, or another uid)."""
        opts: dict[str, Any] = {"propagationPolicy": "Background"}
        if uid:
            opts["preconditions"] = {"uid": uid}
        if grace_s is not None:
            opts["gracePeriodSeconds"] = grace_s
        code, body = await self._call("DELETE", res, namespace, name, json=opts)
        if code in (404, 409):
            return False
        if code >= 300:
            self._raise(f"delete {res[2]}/{name}", code, body)
        return True

    async def merge_patch(
        self,
        res: Resource,
        namespace: str,
        name: str,
        patch: Mapping[str, Any],
        *,
        status: bool = False,
    ) -> dict[str, Any] | None:
        """JSON merge patch (of the status subresource when ``status``); None when gone."""
        code, body = await self._call(
            "PATCH",
            res,
            namespace,
            f"{name}/status" if status else name,
            json=dict(patch),
            headers={"Content-Type": "application/merge-patch+json"},
        )
        if code == 404:
            return None
        if code >= 300:
            self._raise(f"patch {res[2]}/{name}", code, body)
        return cast(dict[str, Any], body)

    async def wait_gone(
        self, res: Resource, namespace: str, name: str, uid: str, timeout_s: float
    ) -> bool:
        """Poll until the object with ``uid`` is gone (404 or replaced); False on timeout."""
        deadline = time.monotonic() + timeout_s
        delay = 0.05
        while True:
            obj = await self.get(res, namespace, name)
            if obj is None or obj["metadata"].get("uid") != uid:
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, 1.0)

    async def delete_confirmed(
        self,
        res: Resource,
        namespace: str,
        name: str,
        uid: str,
        *,
        timeout_s: float,
        grace_s: int | None = None,
    ) -> bool:
        """Delete the object with ``uid`` and wait until the API confirms it gone (the one
        delete-and-confirm of fences, replacements and cleanup); False on timeout."""
        await self.delete(res, namespace, name, uid=uid, grace_s=grace_s)
        return await self.wait_gone(res, namespace, name, uid, timeout_s)

    async def event(
        self,
        involved: Mapping[str, Any],
        *,
        reason: str,
        message: str,
        warning: bool = False,
    ) -> None:
        """Record a core/v1 Event on ``involved`` (a body with apiVersion, kind, metadata)."""
        meta = involved["metadata"]
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
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
            "message": _clip(message, 1000),
            "type": "Warning" if warning else "Normal",
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
            await self.create(EVENTS, meta["namespace"], ev)
        except KubeError as exc:  # events are best effort
            log.warning("event %s on %s not recorded: %s", reason, meta["name"], exc)
