"""A round's Events with its state changes told once (pure).

A stage whose status takes a new state gets a ``StateChanged`` Event ("Active -> Waiting"). In a
hand-over the round's own Event on the same stage usually names that state already (``Slept``:
Asleep, ``Woken``: Active, ``Waiting``: Waiting), so the change is told in that Event's message
instead of an Event of its own: one request less to the API server per such stage and
hand-over. Other changes (to Failed, Loading, ...) keep their ``StateChanged``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["STATE_CHANGED", "fold_state_changes"]

STATE_CHANGED = "StateChanged"
# The new state an Event's reason names.
_NAMES = {"Slept": "Asleep", "Woken": "Active", "Waiting": "Waiting"}

HeldEvent = tuple[Mapping[str, Any], str, str, bool]  # body, reason, message, warning


def _who(body: Mapping[str, Any]) -> tuple[Any, Any]:
    meta = body.get("metadata") or {}
    return meta.get("namespace"), meta.get("uid") or meta.get("name")


def fold_state_changes(held: Sequence[HeldEvent]) -> list[HeldEvent]:
    """``held`` in order, each ``StateChanged`` to a state another held Event of the same stage
    names folded into that Event's message ("...; state Active -> Waiting")."""
    out = list(held)
    dropped: set[int] = set()
    for i, (body, reason, change, _warning) in enumerate(held):
        if reason != STATE_CHANGED:
            continue
        new = change.rsplit("-> ", 1)[-1]
        for j, (other, named, message, warning) in enumerate(out):
            if j in dropped or _NAMES.get(named) != new or _who(other) != _who(body):
                continue
            out[j] = (other, named, f"{message}; state {change}", warning)
            dropped.add(i)
            break
    return [e for k, e in enumerate(out) if k not in dropped]
