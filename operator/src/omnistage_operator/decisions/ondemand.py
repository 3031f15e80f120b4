"""Demand as a fact for the arbiter: OnDemand stages' intents shaped from their workers' demand.

Pure logic: no I/O, no clock (``now`` is given). The arbiter stays as it is; this module only
decides, per OnDemand stage, whether it asks for Active and from when (the arbiter admits
stages by priority, then the most recent ask first):

- a manual ask (``spec.state: Active``) stays what it is (``Manual``): it pins the stage awake;
- held requests are an ask for Active from when the oldest was held (``Demand``), so a stage
  with held requests takes the memory from an equal-priority stage that asked before it;
- an awake stage keeps asking until it is idle: no request in flight or held, and none arrived
  or finished for ``idleAfter`` (unset: it stays until displaced); its ask ranks below every
  held ask of its priority, so a stage with held requests takes its turn (no starvation); an
  idle stage asks for nothing and the arbiter puts it to sleep at its level;
- a stage whose ``spec.state`` turned Asleep after it woke (``asleep_asked_at``) is put to
  sleep now, as an idle one is, whatever its idleAfter or minResidency (issue 19: it stayed
  Active for a minute and more); a request held after that wakes it again; an operator restarted
  in between reads the patch back from ``status.asleepAskedAt`` (``asleep_pending``);
- within ``minResidency`` of its wake an awake stage asks as if just now (``Residency``), so an
  equal- or lower-priority stage's demand cannot displace it; a higher priority still does
  (the arbiter orders by priority first);
- a stage of a pipeline (``batching``, :mod:`.pipelines`) collects a batch: its held requests
  ask below every awake stage (``DEFERRED``: woken only where it fits beside them, so with room
  for both at once and no swap) until ``maxBatch`` are held or the oldest waited ``maxWait``;
  then they ask as any held requests do. The pipeline's ``minResidency`` applies too.

``recheck_at`` says when the answer changes without any new fact (an idle deadline, the end of
a residency): the runner schedules a round then.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import StrEnum

from omnistage_operator.api.activation import Activation
from omnistage_operator.api.pipelines import Batching
from omnistage_operator.decisions.arbiter import StageIntent, WorkerPhase

__all__ = ["DEFERRED", "AwakeReason", "Demand", "DemandInput", "DemandView", "shape_intents"]

DEFERRED = -1.0
"""The ask of held requests collecting a batch: older than any awake stage's (0.0), so it ranks
after them and is admitted only into the room they leave."""

_AWAKE = frozenset({WorkerPhase.ACTIVE, WorkerPhase.WAKING})
_ARBITRATED = _AWAKE | {WorkerPhase.ASLEEP, WorkerPhase.SLEEPING}


class AwakeReason(StrEnum):
    """Why a stage is (or is being made) Active: ``status.awakeReason``."""

    MANUAL = "Manual"
    DEMAND = "Demand"
    RESIDENCY = "Residency"
    PRIORITY = "Priority"


@dataclass(frozen=True)
class Demand:
    """A worker's latest demand report (times in Unix seconds)."""

    held: int = 0
    oldest_hold_start: float | None = None
    last_request: float | None = None
    inflight: int = 0


@dataclass(frozen=True)
class DemandInput:
    """What the shaping needs to know of one stage beside its intent."""

    activation: Activation
    phase: WorkerPhase
    demand: Demand | None = None  # None: no report yet (no request seen)
    awake_since: float | None = None  # when it was last seen becoming Active
    deleting: bool = False
    asleep_asked_at: float | None = None  # when spec.state last turned Asleep (None: unseen)
    # Patched Asleep before this process saw it wake (read back from status after a restart):
    # it sleeps whenever it was seen awake.
    asleep_pending: bool = False
    batching: Batching | None = None  # the batch policy of the stage's pipeline (None: none)

    @property
    def min_residency_s(self) -> float:
        own = self.activation.min_residency_s
        return own if self.batching is None else max(own, self.batching.min_residency_s)


@dataclass(frozen=True)
class DemandView:
    """The shaped intents, why each wanted stage wants Active, when to look again."""

    intents: dict[str, StageIntent]
    reasons: dict[str, AwakeReason]
    demand_asks: frozenset[str]  # stages asking because requests are held
    recheck_at: float | None
    idle: frozenset[str] = frozenset()  # awake stages past idleAfter (to be put to sleep)


def _idle_at(inp: DemandInput) -> float | None:
    """When an awake stage becomes idle (None: never, or busy now)."""
    idle_after = inp.activation.idle_after_s
    demand = inp.demand or Demand()
    if idle_after is None or demand.inflight or demand.held:
        return None
    last = max(demand.last_request or 0.0, inp.awake_since or 0.0)
    return last + idle_after


def shape_intents(
    intents: Mapping[str, StageIntent], inputs: Mapping[str, DemandInput], now: float
) -> DemandView:
    """The intents the arbiter gets (Manual stages, and stages without an input, unchanged)."""
    shaped = dict(intents)
    reasons: dict[str, AwakeReason] = {}
    asks: set[str] = set()
    recheck: list[float] = []
    idle: set[str] = set()
    for name, intent in intents.items():
        inp = inputs.get(name)
        if inp is None or not inp.activation.on_demand:
            if intent.want_active:
                reasons[name] = AwakeReason.MANUAL
            continue
        if intent.want_active:  # spec.state: Active pins an OnDemand stage too
            reasons[name] = AwakeReason.MANUAL
            continue
        if inp.deleting or inp.phase not in _ARBITRATED:
            continue  # not loaded (or going away): it cannot be woken anyway
        demand = inp.demand or Demand()
        awake = inp.phase in _AWAKE
        if demand.held and inp.phase is not WorkerPhase.ACTIVE:
            asked = demand.oldest_hold_start if demand.oldest_hold_start is not None else now
            due = None if inp.batching is None else inp.batching.due_at(demand.held, asked)
            if due is not None and now < due:
                asked = DEFERRED  # collecting its batch: only the room the awake stages leave
                recheck.append(due)
            shaped[name] = replace(intent, want_active=True, requested_active_at=asked)
            reasons[name] = AwakeReason.DEMAND
            asks.add(name)
            continue
        if not awake:
            continue
        patched = inp.asleep_asked_at
        if patched is not None and (inp.asleep_pending or (inp.awake_since or 0.0) <= patched):
            continue  # patched Asleep after it woke: asks nothing, put to sleep now
        idle_at = _idle_at(inp)
        if idle_at is not None and now >= idle_at:
            idle.add(name)  # it asks for nothing and is put to sleep at its level
            continue
        if idle_at is not None:
            recheck.append(idle_at)
        since = inp.awake_since if inp.awake_since is not None else now
        resident_until = since + inp.min_residency_s
        if now < resident_until:
            # Asks as if just now: no equal-priority demand displaces it before the end.
            shaped[name] = replace(intent, want_active=True, requested_active_at=resident_until)
            reasons[name] = AwakeReason.RESIDENCY
            recheck.append(resident_until)
        else:
            # The oldest ask there is: any held request of its priority goes first.
            shaped[name] = replace(intent, want_active=True, requested_active_at=0.0)
            reasons[name] = AwakeReason.DEMAND
    _mark_priority(shaped, reasons, asks)
    return DemandView(
        shaped, reasons, frozenset(asks), min(recheck) if recheck else None, frozenset(idle)
    )


def _mark_priority(
    intents: Mapping[str, StageIntent], reasons: dict[str, AwakeReason], asks: set[str]
) -> None:
    """An awake stage kept over a lower-priority stage's held requests: ``Priority``."""
    for name, reason in reasons.items():
        if reason is not AwakeReason.DEMAND or name in asks:
            continue
        mine = intents[name].priority
        if any(intents[other].priority < mine for other in asks):
            reasons[name] = AwakeReason.PRIORITY
