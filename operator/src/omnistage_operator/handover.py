"""Executes the arbiter's decisions for one group: sleeps, ACK checks, fencing, then wakes.

``run_round`` is written against ``GroupPort`` (observe, probe, start, sleep, wake, fence), so the
same code runs against real workers and the Kubernetes API (``groups.KubeGroupPort``) and against
a simulated fleet in the property tests. One round:

1. observe every stage (GetStatus of every reachable worker, pods from the API) and plan;
2. create the pods of stages that have none and can start asleep (a wake goes through the gate;
   no wake in a round that started pods, their contexts are not measured yet); a stage that
   cannot start asleep (vLLM) is started Active in step 4, once the arbiter admits it and its
   footprint passes the wake gate (``Decision.start``);
3. send every sleep order and every fence order concurrently. A sleep's ACK deadline is its
   drain timeout (when requests are in flight) plus the transition allowance; a sleep whose
   worker is still draining (Sleeping with requests in flight) is waited for up to that bound,
   never fenced. A sleep that gets no answer is retried with backoff under the same task id (it
   may have been delivered) for the retry window; a not-ok ACK is retried after backoff under a
   NEW task id (the worker replays a cached Ack for an old one); a deliberate refusal
   (``WorkerRefused``) is reported, not retried for a window (a FAILED worker is fenced at
   once, other refusals after the normal retries); an ok ACK the device's own figures
   contradict (``facts.ack_contradiction``) is not trusted: reported and fenced. Then the stage
   is fenced (pod deleted, deletion confirmed); a fence not confirmed stays pending (the kube
   side persists ``RoundOutcome.fence_pending``, and the arbiter keeps the gate closed);
4. observe again and plan with this hand-over's bookkeeping (who had to sleep or be fenced, who
   ACKed ok, who was fenced); publish that (``checkpoint``: the sleep ACKs land in status
   first), then wake what the arbiter now allows. A wake refused for lack of memory teaches the
   stage's need (``RoundOutcome.learned_needs``, persisted by the kube side and given back as
   ``StageFacts.learned_need``); it is not asked again until the memory is there, and never when
   the need exceeds the device (``LargerThanDevice``). A wake that ran out of memory during its
   copy (the room taken after the gate; the worker is back asleep and says how much more it
   needed: ``AckFacts.needed_bytes``) teaches the same, at least what the wake needed
   (``oom_need``), and is listed in ``RoundOutcome.wake_oom`` (the kube side backs off).

One stage's error never stops the others: an unexpected exception while starting, sleeping or
waking one stage is recorded for that stage (``RoundOutcome.stage_errors``, shown on its own
resource) and the round goes on; a sleep that raised counts as not ACKed, so the wake gate stays
closed. Only ``LeadershipLost`` ends the round.

Sleeps run as tasks of the group's ``sleep_tasks.SleepTracker``: with the runner's tracker a round
waits only for the sleeps it sent without requests in flight (at most ``round_wait_s``); a
draining sleep goes on in the background and a later round takes its result (steps 3 and 4 run
then), while the hand-over stays open: its sleepers without an ok ACK or a confirmed fence keep
every wake of the group closed, a stage with a sleep out gets no second order and no wake.

Callers serialize rounds per group (``GroupRunner``); nothing here is safe to run twice at once
for the same group.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Protocol

from omnistage_operator import conditions as cond
from omnistage_operator.arbiter import (
    Decision,
    FenceOrder,
    GroupMemory,
    Handover,
    SleepOrder,
    StageFacts,
    StageIntent,
    WorkerPhase,
)
from omnistage_operator.arbiter.admission import claim_too_small
from omnistage_operator.arbiter.plan import plan
from omnistage_operator.facts import AckFacts, ack_contradiction, memory_need
from omnistage_operator.leadership import LeadershipLost
from omnistage_operator.sleep_tasks import SleepTracker

__all__ = [
    "FenceFailed",
    "FenceResult",
    "GroupObservation",
    "GroupPort",
    "Refusal",
    "RoundOutcome",
    "RoundPolicy",
    "SleepResult",
    "WorkerRefused",
    "WorkerUnauthenticated",
    "WorkerUnavailable",
    "run_round",
]

log = logging.getLogger(__name__)


class WorkerUnavailable(Exception):
    """The worker did not answer (unreachable, deadline exceeded, no pod address)."""


class WorkerUnauthenticated(WorkerUnavailable):
    """The worker refused the operator's bearer token: for the hand-over it is unreachable
    (it may hold memory, so it is fenced in the end), and the stage's status says why."""


@dataclass(frozen=True)
class Refusal:
    """A worker's deliberate refusal: the gRPC status code's name and its message."""

    code: str  # "FAILED_PRECONDITION" | "INVALID_ARGUMENT" | "RESOURCE_EXHAUSTED" | ...
    message: str

    @property
    def worker_failed(self) -> bool:
        """The worker is FAILED (it refuses every transition; it holds memory until fenced)."""
        return "worker failed" in self.message

    @property
    def stale_epoch(self) -> bool:
        """The worker has obeyed a newer leader: this operator must stop ordering."""
        return "epoch" in self.message.lower()

    @property
    def need_bytes(self) -> int | None:
        """For a wake refused for lack of memory: the bytes it needs."""
        if self.code == "RESOURCE_EXHAUSTED" or "not enough" in self.message:
            return memory_need(f"not enough: {self.message}")
        return None


class WorkerRefused(Exception):
    """The worker answered with a deliberate refusal (FAILED_PRECONDITION, INVALID_ARGUMENT,
    RESOURCE_EXHAUSTED): not silence, so not retried as if the call was lost."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message

    @property
    def refusal(self) -> Refusal:
        """The refusal as data."""
        return Refusal(self.code, self.message)


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

    async def start(self, stage: str, *, active: bool = False) -> None:
        """Create the stage's children; the worker pod starts asleep, or Active when
        ``active`` (a stage that cannot start asleep, admitted and let through the gate)."""
        ...

    async def probe(self, stage: str) -> StageFacts:
        """GetStatus of one worker as the arbiter's facts (UNREACHABLE when it does not answer);
        used while a sleep is out, to tell a draining worker from a lost one."""
        ...

    async def sleep(
        self,
        stage: str,
        level: int,
        task_id: str,
        *,
        drain_timeout_s: float | None = None,
        timeout_s: float | None = None,
        components: tuple[str, ...] = (),
    ) -> AckFacts:
        """Call Sleep (``drain_timeout_s`` and ``components`` go in the request; ``timeout_s``
        is the call's deadline); raises ``WorkerUnavailable`` when no ACK comes,
        ``WorkerRefused`` when the worker refuses."""
        ...

    async def wake(self, stage: str, task_id: str) -> AckFacts:
        """Call WakeUp; raises ``WorkerUnavailable`` when no ACK comes, ``WorkerRefused`` when
        the worker refuses (RESOURCE_EXHAUSTED: not enough memory, its need in the message)."""
        ...

    async def fence(self, stage: str, reason: str) -> None:
        """Delete the stage's pod and return once the API confirms it is gone; raise
        ``FenceFailed`` when it is not confirmed in time (the fence then stays pending: the
        kube side persists it from ``RoundOutcome.fence_pending``)."""
        ...

    async def checkpoint(self, outcome: RoundOutcome) -> None:
        """The sleeps are ACKed: publish them (status) before any wake is sent."""
        ...


@dataclass(frozen=True)
class RoundPolicy:
    """Retry, deadline and margin settings of a round."""

    ack_retries: int = 3
    backoff_s: float = 0.25
    margin_bytes: int = 0
    # Keep retrying a sleep that got no answer for at least this long before fencing (a worker
    # that refuses connections is usually still starting; a hung one uses up its deadlines).
    retry_window_s: float = 0.0
    # A sleep's ACK deadline: the transition allowance, plus the drain timeout when requests
    # are in flight (the stage's ``drain_timeout_s``, else this default: the worker's own).
    transition_allowance_s: float = 60.0
    default_drain_timeout_s: float = 600.0
    # With a group's ``SleepTracker``: how long a round waits for the sleeps it sent without
    # requests in flight (a draining one is never waited for: it runs on in the background).
    round_wait_s: float = 5.0


@dataclass(frozen=True)
class SleepResult:
    """How one sleep order ended; ``reason``/``message`` are what a condition shows."""

    order: SleepOrder
    task_id: str  # the last task id sent
    ack: AckFacts | None  # the last ACK received, if any
    attempts: int
    fenced: bool = False
    fence_error: str = ""  # the fence was started and not confirmed: it is pending
    seconds: float = 0.0
    task_ids: tuple[str, ...] = ()  # every task id sent, in order (a not-ok ACK: a new one)
    refusal: Refusal | None = None  # the last deliberate refusal, if any
    contradiction: str = ""  # why an ok ACK was not trusted (the device's figures)
    drained: bool = False  # the round waited for the worker's drain of in-flight requests
    error: str = ""  # an unexpected exception ended the sleep (not ACKed, not fenced)

    @property
    def ok(self) -> bool:
        """An ok ACK arrived and the device's own figures agree with it."""
        return self.ack is not None and self.ack.ok and not self.contradiction

    @property
    def fence_pending(self) -> bool:
        """A fence was started and not confirmed gone."""
        return bool(self.fence_error)

    @property
    def worker_s(self) -> float:
        """Time inside the worker: its drain plus its transition (the rest is the operator's)."""
        if self.ack is None:
            return 0.0
        return self.ack.duration_s + self.ack.drain_s

    @property
    def reason(self) -> cond.Reason:
        """A CamelCase reason for the stage's MemoryReleased condition and Events."""
        if self.ok:
            return cond.Reason.SLEEP_ACKNOWLEDGED
        if self.contradiction:
            return cond.Reason.ACK_CONTRADICTED
        if self.error:
            return cond.Reason.STAGE_ERROR
        if self.refusal is not None:
            if self.refusal.worker_failed:
                return cond.Reason.WORKER_FAILED
            return cond.Reason.SLEEP_REFUSED
        if self.ack is not None:
            return cond.Reason.ACK_FAILED
        return cond.Reason.ACK_TIMEOUT

    @property
    def message(self) -> str:
        """What happened, with the figures or the worker's own words."""
        if self.ok and self.ack is not None:
            return f"sleep {self.task_id} ACKed ok"
        if self.contradiction:
            why = self.contradiction
        elif self.error:
            why = f"sleep failed: {self.error}"
        elif self.refusal is not None:
            why = f"refused ({self.refusal.code}): {self.refusal.message}"
        elif self.ack is not None:
            why = f"ACK {self.ack.task_id} not ok: {self.ack.error}"
        else:
            why = "no sleep ACK"
        if self.fenced:
            return f"{why}; pod fenced (deleted, confirmed gone)"
        if self.fence_error:
            return f"{why}; fence pending: {self.fence_error}"
        return why


@dataclass(frozen=True)
class FenceResult:
    """How one fence order of the arbiter ended."""

    order: FenceOrder
    fenced: bool
    error: str = ""


@dataclass
class RoundOutcome:
    """What a round did, for status, events and metrics.

    The kube side persists ``fence_pending`` (fences started and not confirmed; cleared once the
    pod is confirmed gone) and ``learned_needs`` (bytes per stage, from wakes refused for lack
    of memory), and gives them back as ``StageFacts.fence_pending`` / ``learned_need``.
    """

    handover_id: str | None = None
    started: list[str] = field(default_factory=list)
    sleeps: list[SleepResult] = field(default_factory=list)
    fences: list[FenceResult] = field(default_factory=list)
    wakes: dict[str, AckFacts] = field(default_factory=dict)
    wake_errors: dict[str, str] = field(default_factory=dict)
    wake_refusals: dict[str, Refusal] = field(default_factory=dict)
    learned_needs: dict[str, int] = field(default_factory=dict)
    wake_oom: dict[str, AckFacts] = field(default_factory=dict)  # wakes out of device memory
    component_wakes: set[str] = field(default_factory=set)  # wakes of asleep components
    started_active: list[str] = field(default_factory=list)  # pods created Active (vLLM)
    stage_errors: dict[str, str] = field(default_factory=dict)  # unexpected, per stage
    fence_pending: set[str] = field(default_factory=set)
    fence_confirmed: set[str] = field(default_factory=set)
    sleeps_running: frozenset[str] = frozenset()  # sleeps still out (draining) after the round
    handover_began: float | None = None  # monotonic: the hand-over's first order (maybe rounds ago)
    decision: Decision | None = None
    observation: GroupObservation | None = None

    @property
    def changed(self) -> bool:
        """Whether the round acted on anything."""
        return bool(
            self.started or self.sleeps or self.fences or self.wakes or self.wake_errors
            or self.stage_errors
        )  # fmt: skip


def oom_need(ack: AckFacts) -> int:
    """What a wake that ran out of device memory needs, in the units of a footprint (the sum
    over the stage's devices, its context included): what it holds asleep, plus the free
    memory it found, plus how much more it needed."""
    return ack.used_after_bytes + ack.free_after_bytes + ack.needed_bytes


def _refusal_failed(refusal: Refusal | None) -> bool:
    """The refusal says the worker FAILED."""
    return refusal is not None and refusal.worker_failed


def _retry_id(base: str, n: int) -> str:
    return base if n == 0 else f"{base}-r{n}"


async def _sleep_or_fence(
    port: GroupPort, order: SleepOrder, base_id: str, policy: RoundPolicy
) -> SleepResult:
    began = time.monotonic()
    drain = (
        order.drain_timeout_s
        if order.drain_timeout_s is not None
        else policy.default_drain_timeout_s
    )
    bound = drain + policy.transition_allowance_s  # the longest a draining sleep is waited for
    timeout = bound if order.inflight_requests > 0 else policy.transition_allowance_s
    ack: AckFacts | None = None
    refusal: Refusal | None = None
    contradiction = ""
    drained = False
    ids: list[str] = []
    renewals = 0  # not-ok ACKs so far: each retry after one goes under a new task id
    task_id = base_id
    attempts = 0
    attempt = 0

    def result(**kw: object) -> SleepResult:
        return SleepResult(
            order, task_id, ack, attempts, seconds=time.monotonic() - began,
            task_ids=tuple(ids), refusal=refusal, contradiction=contradiction, drained=drained,
            **kw,  # type: ignore[arg-type]
        )  # fmt: skip

    while True:
        attempts += 1
        if task_id not in ids:
            ids.append(task_id)
        log.info(
            "sleep %s: level %d to %s (attempt %d)", task_id, order.level, order.stage, attempts
        )
        lost = False
        try:
            ack = await port.sleep(
                order.stage, order.level, task_id, drain_timeout_s=order.drain_timeout_s,
                timeout_s=max(0.0, min(timeout, bound - (time.monotonic() - began)))
                or policy.transition_allowance_s, components=order.components,
            )  # fmt: skip
        except WorkerRefused as exc:
            refusal = exc.refusal
            log.warning("sleep %s of %s refused: %s", task_id, order.stage, exc)
            if refusal.stale_epoch:
                raise LeadershipLost(f"{order.stage} refused sleep {task_id}: {exc}") from exc
            if refusal.worker_failed or order.components:
                break  # a FAILED worker refuses every transition: fence it now
        except WorkerUnavailable as exc:
            lost = True
            log.warning("sleep %s of %s: no ACK (%s)", task_id, order.stage, exc)
            if order.releases_memory and time.monotonic() - began < bound:
                facts = await port.probe(order.stage)
                if facts.phase is WorkerPhase.SLEEPING and facts.inflight_requests > 0:
                    drained = True  # still draining within its drain timeout: wait, no fence
                    attempts -= 1
                    await asyncio.sleep(min(policy.backoff_s, 1.0))
                    timeout = bound
                    continue
        else:
            if ack.ok:
                why = ack_contradiction(ack, order.held, order.context_bytes)
                if why is None:
                    return result()
                contradiction = why
                log.warning("sleep %s of %s: %s", task_id, order.stage, why)
                break  # retrying only replays (or no-ops) the lie: fence
            log.warning("sleep %s of %s: ACK not ok: %s", task_id, order.stage, ack.error)
            renewals += 1
            task_id = _retry_id(base_id, renewals)
        within_window = lost and time.monotonic() - began < policy.retry_window_s
        if attempts >= max(1, policy.ack_retries) and not within_window:
            break
        await asyncio.sleep(min(policy.backoff_s * (2**attempt), 5.0))
        attempt += 1
    if not order.releases_memory or (order.components and not _refusal_failed(refusal)):
        # A 1->2 deepening of a stage that holds no memory: nothing to protect by fencing. A
        # component sleep that did not go through leaves an Active worker that reports its
        # footprint: it is not counted as freed (no ok ACK), and nothing is fenced.
        return result()
    reason = result().message
    try:
        await port.fence(order.stage, f"sleep {task_id} failed after {attempts} attempts: {reason}")
    except FenceFailed as exc:
        return result(fence_error=str(exc) or "fence not confirmed")
    return result(fenced=True)


async def _fence(port: GroupPort, order: FenceOrder) -> FenceResult:
    try:
        await port.fence(order.stage, f"{order.reason.value}: {order.message}")
    except FenceFailed as exc:
        return FenceResult(order, False, str(exc) or "fence not confirmed")
    return FenceResult(order, True)


async def _wake(
    port: GroupPort, stage: str, task_id: str, policy: RoundPolicy
) -> AckFacts | Refusal | str:
    last = "no wake ACK"
    for attempt in range(max(1, policy.ack_retries)):
        log.info("wake %s: to %s (attempt %d)", task_id, stage, attempt + 1)
        try:
            return await port.wake(stage, task_id)
        except WorkerRefused as exc:
            log.warning("wake %s of %s refused: %s", task_id, stage, exc)
            if exc.refusal.stale_epoch:
                raise LeadershipLost(f"{stage} refused wake {task_id}: {exc}") from exc
            return exc.refusal  # deliberate: not asked again in this round
        except WorkerUnavailable as exc:
            last = f"no wake ACK: {exc}"
            log.warning("wake %s of %s: %s", task_id, stage, last)
        if attempt + 1 < policy.ack_retries:
            await asyncio.sleep(policy.backoff_s * (2**attempt))
    return last


def _failure(stage: str, what: str, exc: Exception) -> str:
    """One stage's unexpected error as a message (``LeadershipLost`` is never caught)."""
    if isinstance(exc, LeadershipLost):
        raise exc
    log.exception("%s of %s failed; the group's other stages go on", what, stage)
    return f"{what} failed: {type(exc).__name__}: {exc}"


async def _guarded_sleep(
    port: GroupPort, order: SleepOrder, base_id: str, policy: RoundPolicy
) -> SleepResult:
    try:
        return await _sleep_or_fence(port, order, base_id, policy)
    except Exception as exc:  # isolated per stage, reported on its resource
        return SleepResult(order, base_id, None, 1, error=_failure(order.stage, "sleep", exc))


async def _start(port: GroupPort, name: str, out: RoundOutcome, *, active: bool) -> bool:
    """Create one stage's pod; an error is that stage's (recorded), not the round's."""
    try:
        await port.start(name, active=active)
    except Exception as exc:  # isolated per stage, reported on its resource
        out.stage_errors[name] = _failure(name, "start", exc)
        return False
    (out.started_active if active else out.started).append(name)
    return True


def _remember(obs: GroupObservation, out: RoundOutcome) -> GroupObservation:
    """The observation with what this round learned and the kube side has not persisted yet."""
    facts = dict(obs.facts)
    for name, seen in obs.facts.items():
        fact = seen
        learned = out.learned_needs.get(name)
        pending = name in out.fence_pending and fact.phase is not WorkerPhase.ABSENT
        if learned is not None and (fact.learned_need or 0) < learned:
            fact = replace(fact, learned_need=learned)
        if pending and not fact.fence_pending:
            fact = replace(fact, fence_pending=True)
        facts[name] = fact
    return GroupObservation(obs.intents, facts, obs.memory)


def _plan(
    obs: GroupObservation,
    handover: Handover | None,
    policy: RoundPolicy,
    started: frozenset[str] = frozenset(),
) -> Decision:
    return plan(
        obs.intents, obs.facts, obs.memory, handover, margin_bytes=policy.margin_bytes,
        started=started,
    )  # fmt: skip


def _sleep_id(hid: str, order: SleepOrder) -> str:
    parts = "-parts" if order.components else ""
    return f"{hid}-{order.stage}-sleep{order.level}{parts}"


async def run_round(
    port: GroupPort,
    policy: RoundPolicy,
    new_id: Callable[[], str],
    tracker: SleepTracker | None = None,
) -> RoundOutcome:
    """Observe, sleep or fence what must release memory, then wake what the arbiter allows.

    ``tracker``: the group's sleeps in flight across rounds (``sleep_tasks``); without one, the
    round waits for every sleep it sent."""
    tracker = tracker if tracker is not None else SleepTracker(background=False)
    out = RoundOutcome()
    done = tracker.collect()  # sleeps that ended since the last round
    tracker.record(done, [])
    if not done:
        tracker.close_if_idle()  # e.g. a round ended by LeadershipLost before it closed it
    obs = await port.observe()
    decision = _plan(obs, tracker.handover(), policy)

    for name, intent in sorted(obs.intents.items()):
        absent = obs.facts.get(name, StageFacts(WorkerPhase.ABSENT)).phase is WorkerPhase.ABSENT
        # no pod on a claim that cannot hold it: its worker could not see its devices
        fits = claim_too_small(intent, obs.memory) is None
        if absent and not intent.starts_active and fits:
            await _start(port, name, out, active=False)
    started = frozenset(out.started)
    if started:
        decision = _plan(obs, tracker.handover(), policy, started)

    handover: Handover | None = tracker.handover()
    busy = tracker.running  # a stage with a sleep in flight gets no second order
    sleeps = [o for o in decision.sleep if o.stage not in busy]
    fences = [o for o in decision.fence if o.stage not in busy]
    if sleeps or fences or done or busy:
        hid = tracker.open(new_id() if handover is None else handover.id)
        out.handover_id = hid
        tracker.fences(fences)
        for order in sleeps:
            task_id = tracker.task_id(order.stage, _sleep_id(hid, order))
            tracker.launch(order, _guarded_sleep(port, order, task_id, policy))
        fenced = list(await asyncio.gather(*(_fence(port, order) for order in fences)))
        await tracker.settle(policy.round_wait_s)
        slept = done + tracker.collect()
        tracker.record(slept, fenced)
        out.sleeps.extend(slept)
        out.fences.extend(fenced)
        out.fence_pending |= {r.order.stage for r in slept if r.fence_pending}
        out.fence_pending |= {r.order.stage for r in fenced if not r.fenced}
        out.fence_confirmed |= {r.order.stage for r in slept if r.fenced}
        out.fence_confirmed |= {r.order.stage for r in fenced if r.fenced}
        out.sleeps_running, out.handover_began = tracker.running, tracker.began
        handover = tracker.handover()
        obs = _remember(await port.observe(), out)
        decision = _plan(obs, handover, policy, started)
        out.decision, out.observation = decision, obs
        if out.sleeps or out.fences:
            await port.checkpoint(out)
        tracker.close_if_idle()

    if decision.wake or decision.start or decision.component_wakes:
        hid = out.handover_id or new_id()
        out.handover_id = hid
        for name in decision.start:
            await _start(port, name, out, active=True)
        for name in decision.component_wakes + decision.wake:
            if name in tracker.running:
                continue  # its own sleep's ACK is not in yet: never woken on a guess
            parts = name in decision.component_wakes  # an Active stage's footprint grows
            task_id = f"{hid}-{name}-wake{'-parts' if parts else ''}"
            if tracker.handover_id == hid:  # a hand-over open across rounds: a fresh id
                task_id = tracker.task_id(f"wake:{name}", task_id)
            try:
                result = await _wake(port, name, task_id, policy)
            except Exception as exc:  # isolated per stage
                out.stage_errors[name] = _failure(name, "wake", exc)
                continue
            need: int | None = None
            if isinstance(result, str):
                out.wake_errors[name] = result
            elif isinstance(result, Refusal):
                out.wake_refusals[name] = result
                out.wake_errors[name] = f"refused ({result.code}): {result.message}"
                need = result.need_bytes
            else:
                out.wakes[name] = result
                if not result.ok:
                    out.wake_errors[name] = result.error or "wake ACK not ok"
                    need = memory_need(result.error)
                    if result.needed_bytes > 0:
                        out.wake_oom[name] = result
                        need = max(need or 0, oom_need(result))
            if parts:
                out.component_wakes.add(name)
            elif need is not None:
                out.learned_needs[name] = need
        obs = _remember(await port.observe(), out)
        decision = _plan(obs, handover, policy, started)

    out.decision = decision
    out.observation = obs
    return out
