"""Executes the arbiter's decisions for one group: sleeps, ACK checks, fencing, then wakes.

``run_round`` is written against ``GroupPort`` (observe, start, sleep, wake, fence), so the same
code runs against real workers and the Kubernetes API (``groups.KubeGroupPort``) and against a
simulated fleet in the property tests. One round:

1. observe every stage (GetStatus of every reachable worker, pods from the API) and plan;
2. create the pods of stages that have none (always asleep: a wake goes through the gate);
3. send every sleep order concurrently; a sleep whose ACK is not ok, or does not come, is retried
   with backoff and the same task id, then the stage is fenced (pod deleted, deletion confirmed);
4. observe again and plan with this hand-over's bookkeeping (who had to sleep, who ACKed ok,
   who was fenced); publish that (``checkpoint``: the sleep ACKs land in status first), then
   wake what the arbiter now allows.

Callers serialize rounds per group (``GroupRunner``); nothing here is safe to run twice at once
for the same group.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from omnistage_operator.arbiter import (
    Decision,
    GroupMemory,
    Handover,
    SleepOrder,
    StageFacts,
    StageIntent,
    WorkerPhase,
    plan,
)
from omnistage_operator.facts import AckFacts

__all__ = [
    "FenceFailed",
    "GroupObservation",
    "GroupPort",
    "RoundOutcome",
    "RoundPolicy",
    "SleepResult",
    "WorkerUnavailable",
    "run_round",
]

log = logging.getLogger(__name__)


class WorkerUnavailable(Exception):
    """The worker did not answer (unreachable, deadline exceeded, no pod address)."""


class WorkerUnauthenticated(WorkerUnavailable):
    """The worker refused the operator's bearer token: for the hand-over it is unreachable
    (it may hold memory, so it is fenced in the end), and the stage's status says why."""


class FenceFailed(Exception):
    """The pod could not be confirmed gone within the deadline."""


@dataclass(frozen=True)
class GroupObservation:
    """Everything the arbiter needs about one group, freshly read."""

    intents: Mapping[str, StageIntent]
    facts: Mapping[str, StageFacts]
    memory: GroupMemory


class GroupPort(Protocol):
    """The side effects a round needs; implemented for Kubernetes and for the simulator."""

    async def observe(self) -> GroupObservation:
        """Read specs, pods and every reachable worker's GetStatus."""
        ...

    async def start(self, stage: str) -> None:
        """Create the stage's children; the worker pod starts asleep."""
        ...

    async def sleep(self, stage: str, level: int, task_id: str) -> AckFacts:
        """Call Sleep; raises ``WorkerUnavailable`` when no ACK comes."""
        ...

    async def wake(self, stage: str, task_id: str) -> AckFacts:
        """Call WakeUp; raises ``WorkerUnavailable`` when no ACK comes."""
        ...

    async def fence(self, stage: str, reason: str) -> None:
        """Delete the stage's pod and return once the API confirms it is gone."""
        ...

    async def checkpoint(self, outcome: RoundOutcome) -> None:
        """The sleeps are ACKed: publish them (status) before any wake is sent."""
        ...


@dataclass(frozen=True)
class RoundPolicy:
    """Retry and margin settings of a round."""

    ack_retries: int = 3
    backoff_s: float = 0.25
    margin_bytes: int = 0
    # Keep retrying a sleep that got no answer for at least this long before fencing (a worker
    # that refuses connections is usually still starting; a hung one uses up its deadlines).
    retry_window_s: float = 0.0


@dataclass(frozen=True)
class SleepResult:
    """How one sleep order ended."""

    order: SleepOrder
    task_id: str
    ack: AckFacts | None  # the last ACK received, if any
    attempts: int
    fenced: bool = False
    fence_error: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """An ok ACK arrived."""
        return self.ack is not None and self.ack.ok


@dataclass
class RoundOutcome:
    """What a round did, for status, events and metrics."""

    handover_id: str | None = None
    started: list[str] = field(default_factory=list)
    sleeps: list[SleepResult] = field(default_factory=list)
    wakes: dict[str, AckFacts] = field(default_factory=dict)
    wake_errors: dict[str, str] = field(default_factory=dict)
    decision: Decision | None = None
    observation: GroupObservation | None = None

    @property
    def changed(self) -> bool:
        """Whether the round acted on anything."""
        return bool(self.started or self.sleeps or self.wakes or self.wake_errors)


async def _sleep_or_fence(
    port: GroupPort, order: SleepOrder, task_id: str, policy: RoundPolicy
) -> SleepResult:
    began = time.monotonic()
    ack: AckFacts | None = None
    attempts = 0
    attempt = 0
    while True:
        attempts = attempt + 1
        log.info(
            "sleep %s: level %d to %s (attempt %d)", task_id, order.level, order.stage, attempts
        )
        try:
            ack = await port.sleep(order.stage, order.level, task_id)
        except WorkerUnavailable as exc:
            log.warning("sleep %s of %s: no ACK (%s)", task_id, order.stage, exc)
        else:
            if ack.ok:
                return SleepResult(order, task_id, ack, attempts, seconds=time.monotonic() - began)
            log.warning("sleep %s of %s: ACK not ok: %s", task_id, order.stage, ack.error)
        within_window = ack is None and time.monotonic() - began < policy.retry_window_s
        if attempts >= max(1, policy.ack_retries) and not within_window:
            break
        await asyncio.sleep(min(policy.backoff_s * (2**attempt), 5.0))
        attempt += 1
    if not order.releases_memory:
        # A 1->2 deepening of a stage that holds no memory: nothing to protect by fencing.
        return SleepResult(order, task_id, ack, attempts, seconds=time.monotonic() - began)
    reason = ack.error if ack is not None else "no sleep ACK"
    try:
        await port.fence(order.stage, f"sleep {task_id} failed after {attempts} attempts: {reason}")
    except FenceFailed as exc:
        return SleepResult(
            order, task_id, ack, attempts, fence_error=str(exc), seconds=time.monotonic() - began
        )
    return SleepResult(order, task_id, ack, attempts, fenced=True, seconds=time.monotonic() - began)


async def _wake(port: GroupPort, stage: str, task_id: str, policy: RoundPolicy) -> AckFacts | str:
    last = "no wake ACK"
    for attempt in range(max(1, policy.ack_retries)):
        log.info("wake %s: to %s (attempt %d)", task_id, stage, attempt + 1)
        try:
            return await port.wake(stage, task_id)
        except WorkerUnavailable as exc:
            last = f"no wake ACK: {exc}"
            log.warning("wake %s of %s: %s", task_id, stage, last)
        if attempt + 1 < policy.ack_retries:
            await asyncio.sleep(policy.backoff_s * (2**attempt))
    return last


def _plan(obs: GroupObservation, handover: Handover | None, policy: RoundPolicy) -> Decision:
    return plan(obs.intents, obs.facts, obs.memory, handover, margin_bytes=policy.margin_bytes)


async def run_round(
    port: GroupPort, policy: RoundPolicy, new_id: Callable[[], str]
) -> RoundOutcome:
    """Observe, sleep what must sleep (fencing failures), then wake what the arbiter allows."""
    out = RoundOutcome()
    obs = await port.observe()
    decision = _plan(obs, None, policy)

    for name in sorted(obs.intents):
        if obs.facts.get(name, StageFacts(WorkerPhase.ABSENT)).phase is WorkerPhase.ABSENT:
            await port.start(name)
            out.started.append(name)

    handover: Handover | None = None
    if decision.sleep:
        hid = new_id()
        out.handover_id = hid
        results = await asyncio.gather(
            *(
                _sleep_or_fence(port, order, f"{hid}-{order.stage}-sleep{order.level}", policy)
                for order in decision.sleep
            )
        )
        out.sleeps.extend(results)
        handover = Handover(
            id=hid,
            sleepers=decision.holder_sleeps,
            acked=frozenset(r.order.stage for r in results if r.ok),
            fenced=frozenset(r.order.stage for r in results if r.fenced),
        )
        obs = await port.observe()
        decision = _plan(obs, handover, policy)
        out.decision, out.observation = decision, obs
        await port.checkpoint(out)

    if decision.wake:
        hid = out.handover_id or new_id()
        out.handover_id = hid
        for name in decision.wake:
            result = await _wake(port, name, f"{hid}-{name}-wake", policy)
            if isinstance(result, str):
                out.wake_errors[name] = result
            else:
                out.wakes[name] = result
                if not result.ok:
                    out.wake_errors[name] = result.error or "wake ACK not ok"
        obs = await port.observe()
        decision = _plan(obs, handover, policy)

    out.decision = decision
    out.observation = obs
    return out
