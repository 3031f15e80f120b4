"""Which status changes wait for the stage's next write: the devices' free memory (pure).

A stage's ``memory.freeBytes`` and ``devices[].freeBytes``/``free`` are the device's free memory,
every process's: they move whenever another stage on the device sleeps or wakes. Written each
time, a hand-over wrote its sleeper twice (its checkpoint, then these figures once the other
stage woke: a third of a 200-stage storm's status writes). A status that differs from the one
last written only there is not written while that write is younger than ``REFRESH_S``: the
figures go out with the stage's next write, or with the first round after ``REFRESH_S``. The
operator's metrics (``omnistage_device_free_bytes``) follow every round regardless.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["REFRESH_S", "deferred"]

REFRESH_S = 60.0
_DEVICE_FREE = frozenset({"freeBytes", "free"})


def deferred(
    written: Mapping[str, Any] | None, status: Mapping[str, Any], written_age_s: float
) -> bool:
    """``status`` differs from ``written`` (the stage's last written status, ``written_age_s``
    old) only in the devices' free memory, and that write is younger than ``REFRESH_S``."""
    if written is None or written_age_s >= REFRESH_S or written == status:
        return False
    return _without_free(written) == _without_free(status)


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
