"""What a restarted operator reads back from a stage's status, once per stage and process.

A previous operator process learned things no worker repeats: a wake that ran out of device
memory and the back-off that follows (``status.wakeBackoff``), and that an awake OnDemand stage
was patched to ``state: Asleep`` and is to sleep now, not when idle (``status.asleepAskedAt``).
Its published ``awakeReason: Manual`` also says the spec asked Active when it last looked, so a
patch to Asleep made while no operator ran (or before the last one saw it) is not missed.

Read once per stage by each process (``adopted``): afterwards this process's own memory is the
truth, and its status writes follow it (a published status may lag behind it).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Protocol

from omnistage_operator.api.spec import StageSpec
from omnistage_operator.decisions.ondemand import AwakeReason
from omnistage_operator.decisions.status import parse_timestamp
from omnistage_operator.decisions.wake_backoff import WakeBackoff
from omnistage_operator.decisions.wake_backoff import from_status as wake_backoff_from_status

__all__ = ["Memory", "adopt_status"]

StageKey = tuple[str, str]


class Memory(Protocol):
    """The runner's per-stage memory this module fills."""

    adopted: set[StageKey]
    wake_backoffs: dict[StageKey, WakeBackoff]
    asleep_asked: dict[StageKey, float]
    asleep_restored: set[StageKey]
    spec_active: dict[StageKey, bool]


def adopt_status(
    memory: Memory,
    key: StageKey,
    status: Mapping[str, Any] | None,
    spec: StageSpec,
    now: float | None = None,
) -> None:
    """Read back, once per stage, the wake back-off and a pending patch to Asleep."""
    if key in memory.adopted:
        return
    memory.adopted.add(key)
    st = status or {}
    backoff = wake_backoff_from_status(st)
    if backoff is not None and key not in memory.wake_backoffs:
        memory.wake_backoffs[key] = backoff
    if spec.wants_active or key in memory.spec_active:
        return  # asked Active now (no patch to Asleep pending), or seen by this process
    asked = parse_timestamp(st.get("asleepAskedAt"))
    if asked is None and st.get("awakeReason") == AwakeReason.MANUAL.value:
        asked = time.time() if now is None else now  # patched while no operator looked
    if asked is not None and spec.activation.on_demand:
        memory.asleep_asked[key] = asked
        memory.asleep_restored.add(key)
