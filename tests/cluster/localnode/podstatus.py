"""Pure logic: a pod's phase and conditions from its containers' states."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any


def now_rfc3339() -> str:
    """The current time as Kubernetes writes it (seconds)."""
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_micro() -> str:
    """The current time as a MicroTime (Lease renewTime)."""
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass
class ContainerStatus:
    """What localnode knows of one container, rendered as a v1.ContainerStatus."""

    name: str
    image: str
    state: dict[str, Any] = field(
        default_factory=lambda: {"waiting": {"reason": "ContainerCreating"}}
    )
    last_state: dict[str, Any] = field(default_factory=dict)
    restart_count: int = 0
    ready: bool = False
    started: bool = False
    pid: int | None = None
    # set once the container will not run again (restartPolicy says so, or the pod ends)
    final: bool = False

    @property
    def running(self) -> bool:
        """Whether the state is running."""
        return "running" in self.state

    @property
    def exit_code(self) -> int | None:
        """The exit code when terminated."""
        term = self.state.get("terminated")
        return None if term is None else int(term["exitCode"])

    def render(self) -> dict[str, Any]:
        """The v1.ContainerStatus object."""
        out: dict[str, Any] = {
            "name": self.name,
            "image": self.image or "localnode",
            "imageID": "",
            "ready": self.ready,
            "started": self.started,
            "restartCount": self.restart_count,
            "state": self.state,
            "lastState": self.last_state,
        }
        if self.pid is not None:
            out["containerID"] = f"localnode://{self.pid}"
        return out


MAX_MESSAGE_BYTES = 4096
LOG_TAIL_LINES = 80
LOG_TAIL_BYTES = 2048


def log_tail(data: bytes, lines: int = LOG_TAIL_LINES, max_bytes: int = LOG_TAIL_BYTES) -> str:
    """The last ``lines`` lines of a log, at most ``max_bytes`` (the kubelet's fallback)."""
    kept = data.splitlines(keepends=True)[-lines:] if lines > 0 else []
    tail = b"".join(kept)[-max_bytes:]
    return tail.decode(errors="replace")


def termination_message(policy: str, exit_code: int, file_text: str, log: bytes) -> str:
    """``state.terminated.message`` as the kubelet writes it.

    The termination-message file's content (at most 4096 bytes); with
    ``FallbackToLogsOnError``, a failed container whose file is empty gets its log's tail.
    """
    if file_text.strip():
        return file_text.encode()[:MAX_MESSAGE_BYTES].decode(errors="replace")
    if policy == "FallbackToLogsOnError" and exit_code != 0:
        return log_tail(log)
    return ""


def pod_phase(init_done: bool, init_failed: bool, containers: list[ContainerStatus]) -> str:
    """Pending, Running, Succeeded or Failed, following the kubelet's rules."""
    if init_failed:
        return "Failed"
    if not init_done:
        return "Pending"
    if any(c.running for c in containers):
        return "Running"
    if containers and all(c.final for c in containers):
        return "Succeeded" if all(c.exit_code == 0 for c in containers) else "Failed"
    if any(
        c.restart_count or "terminated" in c.state or "terminated" in c.last_state
        for c in containers
    ):
        return "Running"  # restarting
    return "Pending"


def pod_conditions(
    previous: list[dict[str, Any]],
    init_done: bool,
    containers: list[ContainerStatus],
    readiness_gates: list[str],
    now: str,
) -> list[dict[str, Any]]:
    """The pod conditions localnode owns, keeping transition times of unchanged ones."""
    prev = {c.get("type"): c for c in previous}
    containers_ready = bool(containers) and all(c.ready for c in containers)
    gates_ok = all(prev.get(g, {}).get("status") == "True" for g in readiness_gates)
    wanted = {
        "PodReadyToStartContainers": True,
        "Initialized": init_done,
        "ContainersReady": containers_ready,
        "Ready": containers_ready and gates_ok,
    }
    out = []
    for type_, ok in wanted.items():
        status = "True" if ok else "False"
        old = prev.get(type_)
        since = old.get("lastTransitionTime", now) if old and old.get("status") == status else now
        cond: dict[str, Any] = {
            "type": type_,
            "status": status,
            "lastTransitionTime": since,
            "lastProbeTime": None,
        }
        if not ok and type_ in ("ContainersReady", "Ready"):
            not_ready = [c.name for c in containers if not c.ready]
            cond["reason"] = "ContainersNotReady"
            cond["message"] = f"containers with unready status: [{' '.join(not_ready)}]"
        out.append(cond)
    return out
