"""What the API server's pod, claim and ResourceSlice objects say, read as plain facts (pure).

No I/O and no clock: callers pass ``now``. Used by ``port_facts`` to tell a worker that exited from
one that is starting, to back off before recreating a crashing worker, and to learn which GPU
UUIDs a group's claim was allocated.

- ``TERMINAL_PHASES``: a pod in one of these has no running container (it holds no memory).
- ``container_started(pod)``: the worker container has run (running or terminated).
- ``exit_message(pod)``: why the worker container ended: its termination message (with
  ``FallbackToLogsOnError``, its last log lines when it wrote none), else the reason and exit
  code; None while it has not ended.
- ``CrashBackoff``: per-stage exponential back-off of pod re-creation (10 s doubling to 5 min,
  reset once a pod has run Active for ``RESET_AFTER_S``, and when the fields a pod is built
  from change: ``current(spec_hash)`` is False then, and an exit counted under another spec
  starts the count again).
- ``claim_device_uuids(claim, slices)``: the ``uuid`` attribute of every device the claim's
  allocation names, from the ResourceSlices that publish them (None until allocated, or when a
  device has no ``uuid``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Final

__all__ = [
    "BACKOFF_INITIAL_S",
    "BACKOFF_MAX_S",
    "RESET_AFTER_S",
    "TERMINAL_PHASES",
    "CrashBackoff",
    "claim_device_uuids",
    "container_started",
    "exit_message",
]

TERMINAL_PHASES: Final = ("Failed", "Succeeded")
BACKOFF_INITIAL_S: Final = 10.0
BACKOFF_MAX_S: Final = 300.0
RESET_AFTER_S: Final = 60.0


def _container_statuses(pod: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return list((pod.get("status") or {}).get("containerStatuses") or ())


def container_started(pod: Mapping[str, Any]) -> bool:
    """Whether a container of the pod has run (state running or terminated)."""
    for cs in _container_statuses(pod):
        state = cs.get("state") or {}
        if "running" in state or "terminated" in state:
            return True
    return False


def exit_message(pod: Mapping[str, Any]) -> str | None:
    """Why the pod's container ended (see the module docstring), or None."""
    for cs in _container_statuses(pod):
        for key in ("state", "lastState"):
            term = (cs.get(key) or {}).get("terminated")
            if not term:
                continue
            message = _last_lines(str(term.get("message") or ""))
            code = term.get("exitCode")
            reason = term.get("reason") or "Terminated"
            head = f"exit code {code} ({reason})" if code is not None else str(reason)
            return f"{head}: {message}" if message else head
    status = pod.get("status") or {}
    if status.get("phase") in TERMINAL_PHASES:
        return str(status.get("message") or status.get("reason") or "pod ended")
    return None


def _last_lines(text: str, lines: int = 3, limit: int = 600) -> str:
    """The end of a termination message: with ``FallbackToLogsOnError`` it is the log's tail,
    whose last lines say why (progress bars and warnings come before)."""
    kept = [ln.strip() for ln in text.replace("\r", "\n").splitlines() if ln.strip()][-lines:]
    out = " | ".join(kept)
    return out if len(out) <= limit else "..." + out[-(limit - 3) :]


@dataclass(frozen=True)
class CrashBackoff:
    """A stage's re-creation back-off: ``restarts`` exits so far, no new pod before ``until``."""

    restarts: int = 0
    until: float = 0.0
    message: str = ""
    last_uid: str = ""  # the pod whose exit was counted last (one count per pod)
    spec_hash: str = ""  # the pod spec digest the exits were counted under ("" : unknown)

    def delay_s(self) -> float:
        """The back-off after ``restarts`` exits: 10 s, 20 s, 40 s, ... at most 5 min."""
        if self.restarts <= 0:
            return 0.0
        return float(min(BACKOFF_INITIAL_S * 2 ** (self.restarts - 1), BACKOFF_MAX_S))

    def exited(self, uid: str, message: str, now: float, spec_hash: str = "") -> CrashBackoff:
        """Count the exit of pod ``uid`` (once) and start the next back-off; an exit under
        another pod spec than the counted ones is the first of its spec."""
        if uid == self.last_uid:
            return self
        restarts = self.restarts + 1 if self.current(spec_hash) else 1
        counted = CrashBackoff(restarts, 0.0, message, uid, spec_hash)
        return replace(counted, until=now + counted.delay_s())

    def current(self, spec_hash: str) -> bool:
        """Whether the exits were counted under the pod spec ``spec_hash`` (a changed spec,
        e.g. a fixed engine argument, deserves a start at once)."""
        return not self.spec_hash or not spec_hash or self.spec_hash == spec_hash

    def waiting(self, now: float) -> float:
        """Seconds left before a new pod may be created (0: now)."""
        return max(0.0, self.until - now)


def _attribute(device: Mapping[str, Any], name: str) -> str | None:
    attr = (device.get("attributes") or {}).get(name)
    if isinstance(attr, Mapping):
        value = attr.get("string") or attr.get("version")
        return str(value) if value else None
    return None


def claim_device_uuids(
    claim: Mapping[str, Any] | None, slices: Iterable[Mapping[str, Any]]
) -> tuple[str, ...] | None:
    """UUIDs of the devices allocated to ``claim``, from the ResourceSlices (sorted), or None
    when the claim is not allocated yet or a device cannot be found with a ``uuid``."""
    results = (((claim or {}).get("status") or {}).get("allocation") or {}).get("devices") or {}
    allocated = list(results.get("results") or ())
    if not allocated:
        return None
    index: dict[tuple[str, str, str], Mapping[str, Any]] = {}
    for sl in slices:
        spec = sl.get("spec") or {}
        driver = spec.get("driver", "")
        pool = (spec.get("pool") or {}).get("name", "")
        for device in spec.get("devices") or ():
            index[(driver, pool, device.get("name", ""))] = device
    uuids = []
    for res in allocated:
        device = index.get((res.get("driver", ""), res.get("pool", ""), res.get("device", "")))
        uuid = _attribute(device, "uuid") if device is not None else None
        if uuid is None:
            return None
        uuids.append(uuid)
    return tuple(sorted(uuids))
