"""What the watches saw: a group's OmniStages and worker pods, without a LIST per round.

kopf keeps two indexes fed by its watches (``handlers.omnistages_by_group`` and
``handlers.worker_pods``; keys from ``stage_keys`` and ``pod_keys``), so a round reads only its
own group's objects, and the API traffic of a round does not grow with the namespace.

A watch lags the API by moments; two overlays of what this process did itself close that gap
where it matters: a pod it created is seen at once (``created``), and a pod the API confirmed
gone is never seen again (``gone``). Safety does not rest on the views: a fence is confirmed by
reading the API, never the watch.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Collection, Hashable, Mapping
from typing import Any

from omnistage_operator.api.labels import GROUP_LABEL, STAGE_LABEL
from omnistage_operator.api.pipelines import Batching, batching_for

__all__ = ["GroupViews", "group_of", "pod_keys", "stage_keys"]

Body = dict[str, Any]
Index = Mapping[Hashable, Collection[Body]]
_GONE_KEPT_S = 600.0  # a confirmed-gone uid is kept this long (a watch lags far less)
_CREATED_KEPT_S = 60.0  # a created pod the watch never showed is dropped after this


def group_of(body: Mapping[str, Any]) -> str | None:
    """``spec.colocation.group`` of a raw body, if any."""
    spec = body.get("spec") or {}
    coloc = spec.get("colocation") or {}
    group = coloc.get("group")
    return group if isinstance(group, str) else None


def stage_keys(body: Mapping[str, Any], namespace: str | None) -> dict[Hashable, Body] | None:
    """An OmniStage's index entries: under ("group", namespace, group) and ("name", ...)."""
    ns = namespace or "default"
    name = (body.get("metadata") or {}).get("name")
    group = group_of(body)
    keys: list[Hashable] = [("name", ns, name)] if name else []
    if group is not None:
        keys.append(("group", ns, group))
    stage = _copy(body)
    return dict.fromkeys(keys, stage) if keys else None


def pod_keys(body: Mapping[str, Any], namespace: str | None) -> dict[Hashable, Body] | None:
    """A worker pod's index entries: under ("stage", namespace, stage) and ("group", ...)."""
    labels = (body.get("metadata") or {}).get("labels") or {}
    ns = namespace or "default"
    keys: list[Hashable] = []
    if labels.get(STAGE_LABEL):
        keys.append(("stage", ns, labels[STAGE_LABEL]))
    if labels.get(GROUP_LABEL):
        keys.append(("group", ns, labels[GROUP_LABEL]))
    if not keys:
        return None
    pod = _copy(body, pod=True)
    return dict.fromkeys(keys, pod)


# The only field of a pod's spec a round reads (where it was scheduled); the rest (containers,
# volumes, the API server's defaults) is what the operator built, kept by the API server.
_POD_SPEC_READ = ("nodeName",)


def _copy(body: Mapping[str, Any], *, pod: bool = False) -> Body:
    """The fields a round reads, as plain data (kopf's bodies are views of a changing event),
    without ``metadata.managedFields``: no round reads them, and on a pod or a stage whose
    status is written often they are a large part of the body (kept per object); of a
    ``pod``'s spec only ``_POD_SPEC_READ``."""
    out = {k: _plain(body[k]) for k in ("apiVersion", "kind", "status") if k in body}
    spec = body.get("spec")
    if pod and isinstance(spec, Mapping):
        out["spec"] = {k: _plain(spec[k]) for k in _POD_SPEC_READ if k in spec}
    elif spec is not None:
        out["spec"] = _plain(spec)
    meta = body.get("metadata")
    if isinstance(meta, Mapping):
        out["metadata"] = {_shared(k): _plain(v) for k, v in meta.items() if k != "managedFields"}
    elif meta is not None:
        out["metadata"] = meta
    return out


# Strings up to this long are shared between entries (``sys.intern``): every decoded body has
# its own copy of each key and of values such as "True" or a condition's reason, and they were
# about half of an entry; longer ones (messages, the diff base) are mostly unique.
_SHARED_MAX = 64


def _plain(value: Any) -> Any:
    """Plain data, its keys and short strings shared (``_SHARED_MAX``)."""
    if isinstance(value, Mapping):
        return {_shared(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return _shared(value)


def _shared(value: Any) -> Any:
    if type(value) is str and len(value) <= _SHARED_MAX:
        return sys.intern(value)
    return value


class GroupViews:
    """A group's stages and pods from the two indexes, with this process's own changes."""

    def __init__(self, stages: Index, pods: Index, pipelines: Index | None = None) -> None:
        self._stages = stages
        self._pods = pods
        self._pipelines: Index = pipelines if pipelines is not None else {}
        self._created: dict[tuple[str, str], tuple[Body, float]] = {}  # pods just created
        self._gone: dict[str, float] = {}  # pod uid: when the API confirmed it gone

    def stages(self, namespace: str, group: str) -> list[Body]:
        """The group's OmniStages (deleting ones included)."""
        return list(self._stages.get(("group", namespace, group), ()))

    def groups(self) -> list[tuple[str, str]]:
        """Every (namespace, group) with a stage not being deleted (what a resync visits)."""
        return [
            (key[1], key[2])
            for key, bodies in list(self._stages.items())
            if isinstance(key, tuple)
            and key[0] == "group"
            and any(not b["metadata"].get("deletionTimestamp") for b in bodies)
        ]

    def stage(self, namespace: str, name: str) -> Body | None:
        """One OmniStage by name, whatever its group."""
        return next(iter(self._stages.get(("name", namespace, name), ())), None)

    def pipelines(self, namespace: str, stages: Collection[str]) -> list[Body]:
        """The OmniPipelines naming any of ``stages`` (each once)."""
        seen: dict[str, Body] = {}
        for stage in stages:
            for body in self._pipelines.get(("stage", namespace, stage), ()):
                seen.setdefault(body["metadata"]["name"], body)
        return [seen[k] for k in sorted(seen)]

    def batching(self, namespace: str, stage: str) -> Batching | None:
        """The batch policy of a stage's pipelines (None: in none)."""
        return batching_for(list(self._pipelines.get(("stage", namespace, stage), ())), namespace)

    def pods(self, namespace: str, group: str, stages: Collection[str]) -> list[Body]:
        """Worker pods of ``stages`` (whatever their group label) and of the group's label."""
        seen: dict[str, Body] = {}
        for key in [("group", namespace, group), *(("stage", namespace, s) for s in stages)]:
            for pod in self._pods.get(key, ()):
                if pod["metadata"]["uid"] not in self._gone:
                    seen.setdefault(pod["metadata"]["uid"], pod)
        labelled = {p["metadata"].get("labels", {}).get(STAGE_LABEL) for p in seen.values()}
        now = time.monotonic()
        for (ns, stage), (pod, when) in list(self._created.items()):
            uid = pod["metadata"]["uid"]
            watched = any(
                p["metadata"]["uid"] == uid for p in self._pods.get(("stage", ns, stage), ())
            )
            if watched or uid in self._gone or now - when > _CREATED_KEPT_S:
                del self._created[(ns, stage)]
            elif ns == namespace and stage in stages and stage not in labelled:
                seen[uid] = pod
        return list(seen.values())

    def created(self, namespace: str, stage: str, pod: Mapping[str, Any]) -> None:
        """This process created ``pod`` (seen before the watch delivers it)."""
        self._created[(namespace, stage)] = (_copy(pod, pod=True), time.monotonic())

    def gone(self, uid: str) -> None:
        """The API confirmed the pod with ``uid`` gone (hidden even while the watch lags)."""
        now = time.monotonic()
        self._gone = {u: t for u, t in self._gone.items() if now - t < _GONE_KEPT_S}
        self._gone[uid] = now
