"""Leader election on a ``coordination.k8s.io/v1`` Lease: the decisions, as pure functions.

``leader.Elector`` does the I/O (read, create and patch the Lease; every acquisition carries
the ``resourceVersion`` it was decided from, so two candidates can never both win one round;
a renewal is conditional on the holder and its epoch) and asks this module what to do. The
rules, as in client-go's leaderelection:

- A candidate judges a Lease expired by its OWN monotonic clock: the Lease is free once the
  record (its ``resourceVersion``) has not changed for ``leaseDurationSeconds`` since this
  candidate first saw it. Wall clocks of different nodes are never compared.
- The holder leads only while its last successful renew was SENT less than ``renew_deadline``
  ago (monotonic). Since ``renew_deadline < lease_duration``, and a candidate can only have seen
  that renew after it was sent, the holder stops leading at least
  ``lease_duration - renew_deadline`` before anyone else may take the Lease over.
- The epoch is ``spec.leaseTransitions`` after this holder acquired the Lease. A Lease created
  by its first holder starts at 1 and every change of holder adds 1, so an elected epoch is
  never 0 (0 is the epoch of an operator without election, which a worker accepts only while
  it has obeyed no elected leader).
- Epochs never go back: the last granted epoch is also kept outside the Lease (``floor``, see
  ``leader.KrEpochStore``), so a Lease deleted and created again continues above it (a
  re-created Lease at 1 would be refused by every worker that obeyed a later epoch).
- The holder renews without reading first (client-go's fast path): its write is applied only
  while the Lease still names it with its epoch (``leaseTransitions``), which proves nobody
  held the Lease in between as well as a ``resourceVersion`` would (a change of holder always
  raises the transitions), but does not need the answer of the previous write. So a renewal
  is sent every retry period whatever the earlier ones are doing, and each may take up to the
  renew deadline. A holder that lost its deadline and finds the Lease still its own leads
  again with the same epoch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import Enum
from typing import Any

__all__ = [
    "Action",
    "LeaseRecord",
    "Observation",
    "Tenure",
    "Timing",
    "TimingError",
    "decide",
    "expires_at",
    "leading",
    "observe",
    "parse_record",
    "release_patch",
    "renew_spec",
    "write_for",
]


class TimingError(ValueError):
    """Lease duration, renew deadline and retry period do not make a safe election."""


@dataclass(frozen=True)
class Timing:
    """``lease_duration > renew_deadline > retry_period > 0`` (seconds)."""

    lease_duration_s: float = 15.0
    renew_deadline_s: float = 10.0
    retry_period_s: float = 2.0

    def __post_init__(self) -> None:
        if not self.retry_period_s > 0:
            raise TimingError(f"retry period must be positive, got {self.retry_period_s}")
        if not self.renew_deadline_s > self.retry_period_s:
            raise TimingError(
                f"renew deadline ({self.renew_deadline_s}s) must exceed the retry period "
                f"({self.retry_period_s}s): a holder gets several tries before it stops leading"
            )
        if not self.lease_duration_s > self.renew_deadline_s:
            raise TimingError(
                f"lease duration ({self.lease_duration_s}s) must exceed the renew deadline "
                f"({self.renew_deadline_s}s): the holder must stop leading before the lease "
                "can expire for the others"
            )

    @property
    def lease_seconds(self) -> int:
        """``spec.leaseDurationSeconds`` (an integer in the API), rounded up."""
        return max(1, math.ceil(self.lease_duration_s))


@dataclass(frozen=True)
class LeaseRecord:
    """What the election reads from a Lease."""

    resource_version: str
    holder: str = ""
    lease_duration_s: int = 0
    transitions: int = 0


@dataclass(frozen=True)
class Observation:
    """A record and when (monotonic) this candidate first saw that version of it."""

    record: LeaseRecord
    seen_at: float


@dataclass(frozen=True)
class Tenure:
    """This process holds the Lease: its epoch and when its last successful write was sent."""

    epoch: int
    renewed_at: float


class Action(Enum):
    """What the elector does next."""

    CREATE = "create"  # no Lease yet
    RENEW = "renew"  # ours: renew it
    TAKE_OVER = "take-over"  # free (no holder) or expired: acquire it
    WAIT = "wait"  # held by another, still valid


def parse_record(raw: Mapping[str, Any]) -> LeaseRecord:
    """The election fields of a Lease object as the API returns it."""
    spec = raw.get("spec") or {}
    return LeaseRecord(
        resource_version=str((raw.get("metadata") or {}).get("resourceVersion", "")),
        holder=str(spec.get("holderIdentity") or ""),
        lease_duration_s=int(spec.get("leaseDurationSeconds") or 0),
        transitions=int(spec.get("leaseTransitions") or 0),
    )


def observe(prev: Observation | None, record: LeaseRecord | None, now: float) -> Observation | None:
    """Keep the first sighting of an unchanged record; a new version restarts its clock."""
    if record is None:
        return None
    if prev is not None and prev.record.resource_version == record.resource_version:
        return prev
    return Observation(record, now)


def expires_at(obs: Observation, timing: Timing) -> float:
    """When (this candidate's monotonic clock) the observed holder's lease runs out.

    The holder's own ``leaseDurationSeconds`` counts; a record without one (written by some
    other tool) gets this candidate's lease duration."""
    duration = obs.record.lease_duration_s or timing.lease_seconds
    return obs.seen_at + duration


def decide(identity: str, obs: Observation | None, now: float, timing: Timing) -> Action:
    """May ``identity`` acquire or renew the Lease it observed, at ``now``?"""
    if obs is None:
        return Action.CREATE
    holder = obs.record.holder
    if holder == identity:
        return Action.RENEW
    if not holder or now >= expires_at(obs, timing):
        return Action.TAKE_OVER
    return Action.WAIT


def _stamp(when: datetime) -> str:
    """MicroTime as the API server writes it."""
    return when.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def renew_spec(identity: str, now_wall: datetime, timing: Timing) -> dict[str, Any]:
    """The ``spec`` fields every write of the holder sets (a renewal sets only these)."""
    return {
        "holderIdentity": identity,
        "leaseDurationSeconds": timing.lease_seconds,
        "renewTime": _stamp(now_wall),
    }


def write_for(
    action: Action,
    identity: str,
    record: LeaseRecord | None,
    now_wall: datetime,
    timing: Timing,
    *,
    floor: int = 0,
) -> tuple[dict[str, Any], int]:
    """The Lease ``spec`` to write for ``action`` and the epoch it grants if the write succeeds.

    ``floor``: the last epoch ever granted (kept outside the Lease); a created or taken-over
    Lease continues above it. For RENEW and TAKE_OVER the caller sends it with
    ``metadata.resourceVersion`` of ``record`` (the API server refuses it with 409 if the
    Lease changed since)."""
    stamp = _stamp(now_wall)
    base = renew_spec(identity, now_wall, timing)
    if action is Action.CREATE:
        epoch = max(floor, 0) + 1
        return {**base, "acquireTime": stamp, "leaseTransitions": epoch}, epoch
    if record is None:
        raise ValueError(f"{action.value} needs the observed record")
    if action is Action.RENEW:
        return base, record.transitions
    if action is Action.TAKE_OVER:
        epoch = max(record.transitions, floor) + 1
        return {**base, "acquireTime": stamp, "leaseTransitions": epoch}, epoch
    raise ValueError("nothing to write while waiting")


def release_patch(now_wall: datetime) -> dict[str, Any]:
    """The ``spec`` a holder writes when it steps down: no holder, so a standby acquires at once
    (its next try) instead of waiting for the lease to expire."""
    stamp = _stamp(now_wall)
    return {"holderIdentity": None, "leaseDurationSeconds": 1, "renewTime": stamp}


def leading(tenure: Tenure | None, now: float, timing: Timing) -> bool:
    """True while the Lease is held and its last renew was sent within the renew deadline."""
    return tenure is not None and now - tenure.renewed_at < timing.renew_deadline_s
