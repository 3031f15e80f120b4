"""Namespace claims between shards: the decisions, as pure functions.

A shard (one operator release: its own ``--lease-name`` and ``--namespace`` list) orders a
namespace's workers only while its leader holds that namespace's claim: a
``coordination.k8s.io/v1`` Lease named ``omnistage-namespace-claim`` in the namespace. Its
``holderIdentity`` names the shard and its leader: ``<lease namespace>/<lease name>#<leader>``
(``claim_holder``). ``k8s.claim_keeper.ClaimKeeper`` does the I/O on the election's thread,
on the election's cadence, and asks this module what to do. The rules are the election's
(``decisions.election``), with the shard in place of the replica:

- A claim whose holder names this shard is this shard's, whoever of its replicas wrote it: a
  standby of the same shard that becomes leader takes it over at once (it rewrites the holder
  with its own leader identity, conditional on the ``resourceVersion`` it read, keeping the
  transition count), so a change of leader inside a shard never frees the namespace.
- A claim of another shard is free once its record has not changed for its
  ``leaseDurationSeconds`` on this shard's own monotonic clock (the other shard stopped or no
  longer serves the namespace), or when it names no holder.
- A shard holds a claim only while its last successful write of it was SENT less than the
  renew deadline ago: since ``renew_deadline < lease_duration`` it stops ordering there at least
  ``lease_duration - renew_deadline`` before another shard may take the claim, so two shards
  never order one namespace's workers at the same time.
- The epoch a shard's orders carry in a namespace (``order_epoch``) puts the claim's transition
  count above the shard's own epoch: every change of shard raises the claim's transitions, so
  a shard that takes a namespace over orders with epochs above any the previous shard's leaders
  used (the workers, which refuse epochs below one they obeyed, would otherwise refuse a shard
  whose Lease counts fewer transitions than the other's), and a shard that lost the claim is
  refused by workers that obeyed the new one. The first claim of a namespace (transitions 1)
  leaves the shard's epoch as it is.
- A claim taken because a round asked for its namespace (cluster-wide, or a ``--namespace``
  pattern), not a literal name of the shard's list, is dropped once the namespace has had no
  group for a lease duration (``claim_dropped``): its holder is cleared as on shutdown, so
  another shard may take it at once, and the shard forgets it; a group that appears again
  claims it again. A group deleted and re-created within that time keeps the claim (and the
  epochs it carried).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from omnistage_operator.decisions.election import (
    Action,
    Observation,
    Tenure,
    Timing,
    expires_at,
    leading,
    write_for,
)

__all__ = [
    "CLAIM_NAME",
    "ClaimState",
    "claim_dropped",
    "claim_holder",
    "claim_write",
    "decide_claim",
    "holds",
    "order_epoch",
    "shard_of",
    "wait_message",
]

CLAIM_NAME = "omnistage-namespace-claim"
_SEP = "#"


def claim_holder(shard: str, leader: str) -> str:
    """The claim's ``holderIdentity``: the shard (``<lease namespace>/<lease name>``) and the
    leader that wrote it."""
    return f"{shard}{_SEP}{leader}"


def shard_of(holder: str) -> str:
    """The shard a holder names (a holder written by another tool is its own shard)."""
    return holder.partition(_SEP)[0]


@dataclass(frozen=True)
class ClaimState:
    """What this shard knows of one namespace's claim: the record as last observed (None: not
    read yet, or absent) and this shard's tenure (None: not held)."""

    obs: Observation | None = None
    tenure: Tenure | None = None


def decide_claim(shard: str, obs: Observation | None, now: float, timing: Timing) -> Action:
    """May ``shard`` take or keep the claim it observed, at ``now``? RENEW: it is this shard's
    (written by this leader or another of the shard's replicas)."""
    if obs is None:
        return Action.CREATE
    holder = obs.record.holder
    if holder and shard_of(holder) == shard:
        return Action.RENEW
    if not holder or now >= expires_at(obs, timing):
        return Action.TAKE_OVER
    return Action.WAIT


def claim_write(
    action: Action, holder: str, obs: Observation | None, now_wall: datetime, timing: Timing
) -> tuple[dict[str, Any], int]:
    """The claim's ``spec`` for ``action`` and its transition count once written (sent with the
    observed ``resourceVersion``, so a concurrent writer makes it fail)."""
    record = obs.record if obs is not None else None
    return write_for(action, holder, record, now_wall, timing)


def holds(state: ClaimState | None, now: float, timing: Timing) -> bool:
    """This shard holds the claim: written by it within the renew deadline."""
    return state is not None and leading(state.tenure, now, timing)


def claim_dropped(vacated_at: float | None, now: float, timing: Timing) -> bool:
    """Drop the claim of a namespace that has had no group since ``vacated_at`` (None: it has
    one, or was never left) once that is a lease duration ago."""
    return vacated_at is not None and now - vacated_at >= timing.lease_duration_s


def order_epoch(claim_transitions: int, shard_epoch: int) -> int:
    """The epoch orders carry in a namespace: the shard's epoch (below 2**32), above it the
    claim's transitions beyond the first (0: an operator without election stays at 0)."""
    if shard_epoch <= 0:
        return 0
    return ((max(claim_transitions, 1) - 1) << 32) + shard_epoch


def wait_message(namespace: str, shard: str, holder: str) -> str:
    """Why a shard's rounds in ``namespace`` wait: the other shard and its leader."""
    other, _, leader = holder.partition(_SEP)
    who = f"shard {other}" + (f" (leader {leader})" if leader else "")
    return (
        f"namespace {namespace} is claimed by {who}; shard {shard} orders no worker here "
        f"until that claim is free (two shards serve this namespace: keep their "
        f"--namespace lists disjoint)"
    )
