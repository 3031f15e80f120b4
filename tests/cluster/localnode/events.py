"""Pure logic: a kubelet-style core/v1 Event about a pod (or one of its containers)."""

from __future__ import annotations

from typing import Any

Obj = dict[str, Any]


def pod_event(
    pod: Obj,
    node: str,
    reason: str,
    message: str,
    now: str,
    *,
    warning: bool = False,
    container: str = "",
) -> Obj:
    """The Event object the kubelet on ``node`` would post."""
    meta = pod["metadata"]
    involved: Obj = {
        "apiVersion": "v1",
        "kind": "Pod",
        "name": meta["name"],
        "namespace": meta["namespace"],
        "uid": meta["uid"],
    }
    if container:
        involved["fieldPath"] = f"spec.containers{{{container}}}"
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
        "involvedObject": involved,
        "reason": reason,
        "message": message[:1024],
        "type": "Warning" if warning else "Normal",
        "source": {"component": "kubelet", "host": node},
        "reportingComponent": "kubelet",
        "reportingInstance": node,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }
