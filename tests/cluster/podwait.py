"""Polling helpers for tests: wait for a pod (or its absence) with a deadline."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from tests.cluster.controlplane import ControlPlane

Obj = dict[str, Any]


def get_pod(cp: ControlPlane, namespace: str, name: str) -> Obj | None:
    """The pod object, or None if it does not exist."""
    proc = cp.kubectl("get", "pod", name, "-n", namespace, "-o", "json", check=False)
    if proc.returncode != 0:
        if "NotFound" in proc.stderr:
            return None
        raise RuntimeError(proc.stderr)
    pod: Obj = json.loads(proc.stdout)
    return pod


def condition(obj: Obj, type_: str) -> Obj | None:
    """The status condition of ``type_``, if present."""
    for cond in (obj.get("status") or {}).get("conditions") or []:
        if cond.get("type") == type_:
            return dict(cond)
    return None


def is_ready(pod: Obj) -> bool:
    """Whether the pod's Ready condition is True."""
    cond = condition(pod, "Ready")
    return bool(cond and cond.get("status") == "True")


def wait_pod(
    cp: ControlPlane,
    namespace: str,
    name: str,
    check: Callable[[Obj], bool],
    what: str,
    *,
    timeout: float = 60,
) -> Obj:
    """Poll the pod until ``check(pod)``; fail with its last status after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    pod: Obj | None = None
    while time.monotonic() < deadline:
        pod = get_pod(cp, namespace, name)
        if pod is not None and check(pod):
            return pod
        time.sleep(0.2)
    status = json.dumps((pod or {}).get("status"), indent=1)[:3000]
    raise AssertionError(
        f"pod {namespace}/{name} not {what} within {timeout:.0f}s; last status: {status}"
    )


def wait_gone(cp: ControlPlane, namespace: str, name: str, timeout: float = 60) -> None:
    """Poll until the pod no longer exists."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if get_pod(cp, namespace, name) is None:
            return
        time.sleep(0.2)
    raise AssertionError(f"pod {namespace}/{name} still exists after {timeout:.0f}s")


def envdump(log_text: str) -> Obj:
    """The last ENVDUMP record of a ``tests.cluster.testpods.envdump`` container log."""
    lines = [line for line in log_text.splitlines() if line.startswith("ENVDUMP ")]
    if not lines:
        raise AssertionError(f"no ENVDUMP line in log:\n{log_text[-2000:]}")
    data: Obj = json.loads(lines[-1][len("ENVDUMP ") :])
    return data
