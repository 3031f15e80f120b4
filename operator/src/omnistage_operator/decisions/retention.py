"""What the operator keeps per stage and per group, and the rules for letting it go (pure;
``runtime.group_forget`` applies them to the runner).

``STAGE_MAPS`` and ``GROUP_MAPS`` name every per-stage and per-group attribute of
``runtime.runner.GroupRunner``; a unit test fails on an attribute that is in neither nor in
``PROCESS_MAPS``, so a new one is forgotten with its stage or group from the start.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = ["GROUP_MAPS", "PROCESS_MAPS", "STAGE_MAPS", "left", "live"]

# The runner's dicts and sets keyed by (namespace, stage).
STAGE_MAPS = (
    "asks", "created", "reached", "last_acks", "fenced", "auth_errors", "fence_pending",
    "fences_cleared", "learned", "peaks", "backoffs", "wake_backoffs", "device_mismatch",
    "spec_active", "deepen_refused", "asleep_asked", "asleep_restored", "adopted",
    "active_since", "sleep_problems", "wake_problems", "component_problems",
    "component_refused", "stage_problems", "published", "written_at", "claim_waits",
)  # fmt: skip
# ... keyed by (namespace, group).
GROUP_MAPS = ("_loops", "_retry_in", "kept", "_sleeps", "_members")
# ... keyed otherwise: the group claims' cache ("namespace/claim", dropped with the group),
# namespaces with the token Secret, the epoch last ordered with per
# namespace (dropped with the namespace's last group, as the claim a round asked for is).
PROCESS_MAPS = ("_claims", "_claim_errors", "_secrets", "claim_epochs")


def live(bodies: Iterable[Mapping[str, Any]]) -> bool:
    """Whether a group still has a stage that is not being deleted."""
    return any(not (b.get("metadata") or {}).get("deletionTimestamp") for b in bodies)


def left(
    members: Mapping[str, str], current: Callable[[str], Mapping[str, Any] | None]
) -> list[str]:
    """The ``members`` (stage name: uid) that are gone from the watch, or there under another
    uid (deleted and re-created): their entries are another stage's, or no stage's."""
    out = []
    for name, uid in members.items():
        body = current(name)
        if body is None or (body.get("metadata") or {}).get("uid") != uid:
            out.append(name)
    return out
