"""Where the leader election's state lives: the Lease, and the last granted epoch beside it.

``KrLeaseStore`` reads, creates and writes one ``coordination.k8s.io/v1`` Lease (kr8s objects):
an acquisition is a merge patch carrying the ``resourceVersion`` it was decided from (409 when
another replica wrote first), a renewal a JSON patch whose ``test`` operations make the API
server apply it only while the Lease names the holder with its epoch (422 otherwise), so it needs
no read first. ``KrEpochStore`` keeps the last granted epoch in a ConfigMap, so a Lease deleted
and created again continues above it. ``leader.Elector`` decides; this module only does the I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import kr8s
from kr8s.asyncio.objects import new_class

__all__ = [
    "EPOCH_KEY",
    "EpochStore",
    "KrEpochStore",
    "KrLeaseStore",
    "LeaseStore",
]

Lease = new_class("Lease", "coordination.k8s.io/v1", namespaced=True)


class LeaseStore(Protocol):
    """Reads and conditional writes of one Lease (None: absent, or the write lost a race)."""

    async def get(self) -> dict[str, Any] | None:
        """The Lease, or None when it does not exist."""
        ...

    async def create(self, spec: Mapping[str, Any]) -> dict[str, Any] | None:
        """Create it with ``spec``; None when it already exists."""
        ...

    async def patch(self, resource_version: str, spec: Mapping[str, Any]) -> dict[str, Any] | None:
        """Merge ``spec`` if the Lease is still at ``resource_version``; None on conflict."""
        ...

    async def renew(
        self, holder: str, transitions: int, spec: Mapping[str, Any]
    ) -> dict[str, Any] | None:
        """Set ``spec``'s fields if the Lease still names ``holder`` with ``transitions``
        (whatever its ``resourceVersion``); None when it does not, or is gone."""
        ...


def _code(exc: kr8s.ServerError) -> int:
    return exc.response.status_code if exc.response is not None else 0


class KrLeaseStore:
    """``LeaseStore`` with kr8s objects."""

    def __init__(self, api: Any, namespace: str, name: str) -> None:
        self.api = api
        self.namespace = namespace
        self.name = name

    def _obj(self, spec: Mapping[str, Any] | None = None) -> Any:
        raw: dict[str, Any] = {"metadata": {"name": self.name, "namespace": self.namespace}}
        if spec is not None:
            raw["spec"] = dict(spec)
        return Lease(raw, api=self.api)

    async def get(self) -> dict[str, Any] | None:
        """GET the Lease by name."""
        obj = self._obj()
        try:
            await obj.refresh()
        except kr8s.NotFoundError:
            return None
        return dict(obj.raw.to_dict())

    async def create(self, spec: Mapping[str, Any]) -> dict[str, Any] | None:
        """POST the Lease; None when another replica created it first (409)."""
        obj = self._obj(spec)
        try:
            await obj.create()
        except kr8s.ServerError as exc:
            if _code(exc) == 409:
                return None
            raise
        return dict(obj.raw.to_dict())

    async def patch(self, resource_version: str, spec: Mapping[str, Any]) -> dict[str, Any] | None:
        """Merge patch with ``metadata.resourceVersion``: the API server applies it only to that
        version of the Lease (409 otherwise, returned as None)."""
        obj = self._obj()
        body = {"metadata": {"resourceVersion": resource_version}, "spec": dict(spec)}
        try:
            await obj.patch(body)
        except kr8s.ServerError as exc:
            if _code(exc) == 409:
                return None
            raise
        except kr8s.NotFoundError:
            return None
        return dict(obj.raw.to_dict())

    async def renew(
        self, holder: str, transitions: int, spec: Mapping[str, Any]
    ) -> dict[str, Any] | None:
        """A JSON patch that tests ``holderIdentity`` and ``leaseTransitions`` before it sets
        the fields: the API server applies it to the Lease as it is then, or refuses it (422)
        when a test fails."""
        ops: list[dict[str, Any]] = [
            {"op": "test", "path": "/spec/holderIdentity", "value": holder},
            {"op": "test", "path": "/spec/leaseTransitions", "value": transitions},
            *({"op": "add", "path": f"/spec/{k}", "value": v} for k, v in spec.items()),
        ]
        obj = self._obj()
        try:
            await obj.patch(ops, type="json")
        except kr8s.NotFoundError:
            return None
        except kr8s.ServerError as exc:
            if _code(exc) in (409, 422):
                return None
            raise
        return dict(obj.raw.to_dict())


EPOCH_KEY = "epoch"


class EpochStore(Protocol):
    """Where the last granted epoch outlives the Lease (a Lease deleted and created again
    continues above it)."""

    async def get(self) -> int:
        """The last epoch persisted (0: none)."""
        ...

    async def put(self, epoch: int) -> None:
        """Persist ``epoch`` (never lowers what is stored; raises when it cannot be written)."""
        ...


ConfigMap = new_class("ConfigMap", "v1", namespaced=True)


class KrEpochStore:
    """``EpochStore`` in a ConfigMap beside the Lease (``<lease name>-epoch``, key ``epoch``):
    the last epoch a holder acquired, written before that holder orders anything."""

    def __init__(self, api: Any, namespace: str, name: str) -> None:
        self.api = api
        self.namespace = namespace
        self.name = name

    def _obj(self, data: Mapping[str, str] | None = None) -> Any:
        raw: dict[str, Any] = {"metadata": {"name": self.name, "namespace": self.namespace}}
        if data is not None:
            raw["data"] = dict(data)
        return ConfigMap(raw, api=self.api)

    async def _read(self) -> tuple[int, str] | None:
        obj = self._obj()
        try:
            await obj.refresh()
        except kr8s.NotFoundError:
            return None
        raw = obj.raw.to_dict()
        text = str((raw.get("data") or {}).get(EPOCH_KEY) or "0")
        version = str(raw["metadata"].get("resourceVersion", ""))
        return (int(text) if text.isdigit() else 0), version

    async def get(self) -> int:
        """The stored epoch (0 when the ConfigMap does not exist)."""
        found = await self._read()
        return 0 if found is None else found[0]

    async def put(self, epoch: int) -> None:
        """Create the ConfigMap, or raise its epoch (a patch conditional on what was read: a
        concurrent writer makes it read again; a higher stored epoch is left alone)."""
        for _ in range(5):
            found = await self._read()
            if found is None:
                try:
                    await self._obj({EPOCH_KEY: str(epoch)}).create()
                    return
                except kr8s.ServerError as exc:
                    if _code(exc) == 409:
                        continue
                    raise
            stored, version = found
            if stored >= epoch:
                return
            body = {"metadata": {"resourceVersion": version}, "data": {EPOCH_KEY: str(epoch)}}
            try:
                await self._obj().patch(body)
                return
            except kr8s.ServerError as exc:
                if _code(exc) != 409:
                    raise
        raise RuntimeError(f"epoch {epoch} not persisted in {self.namespace}/{self.name}")
