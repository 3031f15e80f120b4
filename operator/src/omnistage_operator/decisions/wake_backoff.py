"""Back-off after a wake that ran out of device memory, or that its worker failed (pure logic,
no I/O).

A wake the gate let through can still run out of memory during its copy: another tenant took
the room between the operator's measurement and the copy. The worker goes back to sleep and
says how much more it needed; the operator charges the stage at least that (a learned need,
so the gate waits until the measured free memory covers it) and, in case the room comes and
goes, does not ask again before a back-off that doubles with each such wake in a row: 1, 2,
4, ... 30 s. A wake that goes through ends it. The back-off is kept in ``status.wakeBackoff``
(``to_status``) and read back by a restarted operator (``from_status``).

A wake the worker failed for another reason (its ACK not ok; a pre-warmed vLLM stage's first
wake starts its engine, which may refuse its flags or find no room for its KV cache) backs off
the same way (``after_failure``, ``failure_message``): the worker is back asleep, asking again
at once would fail again, and meanwhile the group's other stages are admitted. A new pod (the
spec changed) ends it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omnistage_operator.decisions.facts import AckFacts
from omnistage_operator.decisions.status import format_timestamp, parse_timestamp

__all__ = [
    "FIRST_S",
    "MAX_S",
    "WakeBackoff",
    "failure_message",
    "from_status",
    "oom_message",
    "to_status",
]

FIRST_S = 1.0
MAX_S = 30.0
REASON = "WakeOutOfMemory"


@dataclass(frozen=True)
class WakeBackoff:
    """Wakes out of memory in a row, and until when (wall clock) no wake is sent."""

    count: int = 0
    until: float = 0.0
    needed_bytes: int = 0  # how much more the last such wake needed than it found free

    def after_oom(self, now: float, needed_bytes: int = 0) -> WakeBackoff:
        """One more wake ran out of memory at ``now``, short of ``needed_bytes``."""
        count = self.count + 1
        return WakeBackoff(count, now + min(MAX_S, FIRST_S * 2 ** (count - 1)), needed_bytes)

    def after_failure(self, now: float) -> WakeBackoff:
        """One more wake failed (not out of memory) at ``now``."""
        return self.after_oom(now, 0)

    def left(self, now: float) -> float:
        """Seconds until a wake may be sent again (0: now)."""
        return max(0.0, self.until - now)


def oom_message(ack: AckFacts, charged: int, backoff: WakeBackoff, now: float) -> str:
    """The condition's and Event's words, with the figures of the ACK."""
    per_device = ", ".join(
        f"device {d.index}{f' ({d.uuid})' if d.uuid else ''}: {d.free_after} free"
        for d in ack.devices
    )
    where = f" ({per_device})" if per_device else ""
    return (
        f"wake {ack.task_id} ran out of device memory: it needed {ack.needed_bytes} bytes more "
        f"than the {ack.free_after_bytes} free{where}; back asleep at level {ack.level}; "
        f"charged {charged} bytes from now on; no wake for {backoff.left(now):.0f}s and until "
        "the measured free memory covers it"
    )


def failure_message(ack: AckFacts, backoff: WakeBackoff, now: float) -> str:
    """The condition's words on a wake its worker failed, with the back-off."""
    error = ack.error or "wake ACK not ok"
    return (
        f"wake {ack.task_id} failed: {error}; back asleep at level {ack.level}; no wake for "
        f"{backoff.left(now):.0f}s ({backoff.count} in a row)"
    )


def to_status(backoff: WakeBackoff | None) -> dict[str, Any] | None:
    """``status.wakeBackoff`` (None: no back-off)."""
    if backoff is None:
        return None
    return {
        "attempts": backoff.count,
        "until": format_timestamp(backoff.until),
        "neededBytes": backoff.needed_bytes,
    }


def from_status(status: Mapping[str, Any] | None) -> WakeBackoff | None:
    """The back-off a previous operator process wrote in ``status.wakeBackoff``."""
    data = (status or {}).get("wakeBackoff")
    if not isinstance(data, Mapping):
        return None
    until = parse_timestamp(data.get("until"))
    attempts = data.get("attempts")
    if until is None or not isinstance(attempts, int) or attempts < 1:
        return None
    needed = data.get("neededBytes")
    return WakeBackoff(attempts, until, needed if isinstance(needed, int) else 0)
