"""Which status changes wait for the stage's next write: the devices' free memory (pure).

A stage's ``memory.freeBytes`` and ``devices[].freeBytes``/``free`` are the device's free memory,
every process's: they move whenever another stage on the device sleeps or wakes. Written each
time, a hand-over wrote its sleeper twice (its checkpoint, then these figures once the other
stage woke: a third of a 200-stage storm's status writes). A status that differs from the one
last written only there is not written while that write is younger than ``REFRESH_S``: the
figures go out with the stage's next write, or with the first round after ``REFRESH_S``, unless
another stage's last written status already shows every one of its devices at that free memory
(``shown_free``): the stage of the group that woke or served and moved it was written with the
figure, and a storm longer than ``REFRESH_S`` (1000 groups on two cores) wrote each stage once
more for it. The operator's metrics (``omnistage_device_free_bytes``) follow every round
regardless.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["REFRESH_S", "all_shown", "deferred", "only_free_moved", "shown_free"]

REFRESH_S = 60.0
_DEVICE_FREE = frozenset({"freeBytes", "free"})


def deferred(
    written: Mapping[str, Any] | None,
    status: Mapping[str, Any],
    written_age_s: float,
    shown: Mapping[str, int] | None = None,
) -> bool:
    """``status`` differs from ``written`` (the stage's last written status, ``written_age_s``
    old) only in the devices' free memory, and that write is younger than ``REFRESH_S`` or
    ``shown`` (``shown_free`` of the other stages' written statuses) has every device of
    ``status`` at its free memory."""
    if not only_free_moved(written, status):
        return False
    return written_age_s < REFRESH_S or (shown is not None and all_shown(status, shown))


def only_free_moved(written: Mapping[str, Any] | None, status: Mapping[str, Any]) -> bool:
    """``status`` differs from ``written`` only in the devices' free memory."""
    if written is None or written == status:
        return False
    return _without_free(written) == _without_free(status)


def shown_free(written: Iterable[tuple[float, Mapping[str, Any] | None]]) -> dict[str, int]:
    """Each device's free memory (by UUID) as the latest of ``written`` shows it: ``(when
    written, status)`` pairs, the other stages' last written statuses."""
    latest: dict[str, tuple[float, int]] = {}
    for at, status in written:
        for d in (status or {}).get("devices") or ():
            uuid, free = d.get("uuid"), d.get("freeBytes")
            valid = isinstance(uuid, str) and bool(uuid) and isinstance(free, int)
            if valid and (uuid not in latest or at > latest[uuid][0]):
                latest[uuid] = (at, free)
    return {uuid: free for uuid, (_, free) in latest.items()}


def all_shown(status: Mapping[str, Any], shown: Mapping[str, int]) -> bool:
    """``shown`` (``shown_free``) has every device of ``status`` at its free memory."""
    devices = status.get("devices") or ()
    return bool(devices) and all(
        isinstance(d, Mapping) and d.get("uuid") in shown and shown[d["uuid"]] == d.get("freeBytes")
        for d in devices
    )


def _without_free(status: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(status)
    memory = out.get("memory")
    if isinstance(memory, Mapping):
        out["memory"] = {k: v for k, v in memory.items() if k != "freeBytes"}
    devices = out.get("devices")
    if isinstance(devices, list):
        out["devices"] = [
            {k: v for k, v in d.items() if k not in _DEVICE_FREE} if isinstance(d, Mapping) else d
            for d in devices
        ]
    return out
