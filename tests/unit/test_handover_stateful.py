"""Property-based tests of the arbiter driven through the real hand-over round, on GPU physics.

``run_round`` (operator/src/omnistage_operator/decisions/handover/rounds.py) runs against a
simulated fleet whose device behaves like a real GPU in everything the operator can observe (issue
14):

- a driver reserve: free memory is below the total even when nothing runs;
- a CUDA context per started worker process, held while the process lives, asleep or not;
- memory taken while serving: a peak above the weights, kept (allocator pool) until the sleep;
- a wake that does not fit is refused by the worker (RESOURCE_EXHAUSTED, with its need);
- faults: ACKs lost before or after the transition, transient not-ok ACKs, sleeps that leave
  memory behind (the worker turns FAILED, never Asleep, and keeps the memory), ACKs that say ok
  while the memory stays (the device's own free figures do not move), refusals (level 2
  unsupported), slow drains, crashes, hangs, container restarts, fences the kubelet never
  confirms, and operator restarts between rounds or right after a sleep's ACK (everything in
  memory forgotten; what the kube side persists in status -- pending fences, learned needs --
  survives).

The port builds the operator's view with the operator's own code (``WorkerReport.stage_facts``,
``memory.group_memory``), and persists what the kube side persists.

Invariants:
- within a round: no wake while a stage told to sleep lacks an ok ACK or a confirmed fence, and
  not before the sleep ACKs were published;
- across rounds: no WakeUp is ever sent while any other stage of the group may still hold memory
  beyond its context (Failed with a residual, a lying ACK, a pending fence, hung, a stage that
  must sleep) unless it is an honest co-tenant that wants Active (admitted beside it);
- a wake whose footprint the operator knew is never refused for lack of memory;
- the device never holds more than its total;
- after faults stop, no stage outside the admitted set holds memory, admitted stages are Active
  unless the measured free memory does not cover them, the first stage in admission order that
  fits is Active, and a further round orders nothing.

On the code before issue 14 this model fails: a stage without ``vram.request`` never wakes
(footprint = capacity > free, the liveness check fails); an ACK that lies is accepted and the
next stage woken beside the memory it still holds (cross-round check); a wake follows the start
of a pod in the same round on a free figure that predates its context (refused although the
footprint was known); a not-ok sleep retried under its old id only replays the not-ok ACK.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from omnistage_operator.decisions.arbiter import (
    BlockReason,
    GroupMemory,
    StageFacts,
    StageIntent,
    WorkerPhase,
)
from omnistage_operator.decisions.arbiter.admission import admission_order
from omnistage_operator.decisions.facts import AckFacts, DeviceFigures, WorkerReport
from omnistage_operator.decisions.handover import (
    FenceFailed,
    GroupObservation,
    RoundOutcome,
    RoundPolicy,
    WorkerRefused,
    WorkerUnavailable,
)
from omnistage_operator.decisions.handover.rounds import run_round
from omnistage_operator.decisions.memory import group_memory

MI = 1 << 20
GI = 1 << 30
UNIT = GI  # sizes are drawn in GiB (an ACK's lie must exceed max(2% of total, 256 MiB))
RESERVE = 512 * MI  # the driver's reserve: never free
CONTEXT = 612 * MI  # a process's CUDA context (H100, LIMITS.md), held while it lives
UUID = "GPU-sim-0"
MARGIN = 0
SLEEP_OUTCOMES = st.sampled_from(
    ["ok", "ok", "ok", "not_ok", "lost_before", "lost_after", "residual", "lie", "refuse",
     "slow_drain", "residual_die", "lie_die", "ok_die"]
)  # fmt: skip


class OperatorDied(Exception):
    """The operator process ends right after a sleep's ACK reached it (before any fence)."""


@dataclass
class SimWorker:
    """One stage's pod and process, with the memory it truly holds (context included)."""

    weights: int
    extra: int  # activations and pools taken while serving, above the weights
    pod: bool = False
    alive: bool = False
    responsive: bool = True
    state: WorkerPhase = WorkerPhase.ASLEEP
    level: int = 1
    used: int = 0
    lied: bool = False  # its last ok sleep ACK claimed memory it still holds
    inflight: int = 0
    measured_fp: int | None = None
    measured_peak: int | None = None
    last_ack: AckFacts | None = None
    acks: dict[str, AckFacts] = field(default_factory=dict)

    @property
    def beyond_context(self) -> int:
        return max(0, self.used - CONTEXT) if self.pod and self.alive else 0


class SimPort:
    """A ``GroupPort`` over simulated workers on one simulated GPU; checks the promise."""

    def __init__(self, world: HandoverMachine) -> None:
        self.world = world
        self.calls: list[tuple[str, str]] = []
        self.unresolved: set[str] = set()  # told to sleep this round, no ok ACK, not fenced

    def _outcome(self) -> str:
        outcomes = self.world.outcomes
        return outcomes.pop(0) if outcomes else "ok"

    def _report(self, wk: SimWorker) -> WorkerReport:
        w = self.world
        free = w.free()
        reported_used = CONTEXT if wk.lied else wk.used
        return WorkerReport(
            phase=wk.state,
            level=wk.level if wk.state is WorkerPhase.ASLEEP else None,
            used_bytes=reported_used,
            free_bytes=free,
            total_bytes=w.capacity,
            source="nvml",
            active_footprint_bytes=wk.measured_fp or 0,
            peak_active_bytes=wk.measured_peak or 0,
            context_bytes=CONTEXT,
            inflight_requests=wk.inflight,
            last_ack=wk.last_ack,
            devices=(
                DeviceFigures(UUID, 0, w.capacity, used_after=reported_used, free_after=free),
            ),
        )

    async def observe(self) -> GroupObservation:
        w = self.world
        facts: dict[str, StageFacts] = {}
        reports: dict[str, WorkerReport] = {}
        for name, wk in w.workers.items():
            pending = w.fence_pending.get(name, False)
            if not wk.pod:
                facts[name] = StageFacts(WorkerPhase.ABSENT, fence_pending=pending)
            elif wk.alive and wk.responsive:
                w.reached.add(name)
                reports[name] = self._report(wk)
                facts[name] = reports[name].stage_facts(
                    fence_pending=pending, learned_need=w.learned.get(name)
                )
            elif name in w.created and name not in w.reached:
                facts[name] = StageFacts(WorkerPhase.STARTING, fence_pending=pending)
            else:
                facts[name] = StageFacts(WorkerPhase.UNREACHABLE, fence_pending=pending)
        memory = group_memory(reports, {n: 1 for n in w.intents}, [UUID])
        if not w.measure_free:
            memory = GroupMemory(memory.capacity, None, claim_uuids=memory.claim_uuids)
        return GroupObservation(dict(w.intents), facts, memory)

    async def probe(self, stage: str) -> StageFacts:
        return (await self.observe()).facts[stage]

    async def start(self, stage: str, *, active: bool = False) -> None:
        w = self.world
        wk = w.workers[stage]
        assert not wk.pod, f"start of {stage} whose pod exists"
        wk.pod, wk.responsive, wk.lied, wk.inflight = True, True, False, 0
        wk.state, wk.level = WorkerPhase.ASLEEP, w.intents[stage].sleep_level
        wk.measured_fp = wk.measured_peak = wk.last_ack = None
        wk.acks = {}
        # The new process touches the device: its context, or it dies at CUDA init.
        wk.alive = w.free() >= CONTEXT
        wk.used = CONTEXT if wk.alive else 0
        w.created.add(stage)
        w.reached.discard(stage)
        self.calls.append(("start", stage))

    def _check(self, stage: str) -> SimWorker:
        wk = self.world.workers[stage]
        if not (wk.pod and wk.alive and wk.responsive):
            raise WorkerUnavailable(f"{stage} does not answer")
        return wk

    def _ack(
        self, wk: SimWorker, task_id: str, ok: bool, before: int, free_before: int, **kw: object
    ) -> AckFacts:
        free = self.world.free()
        dev = DeviceFigures(
            UUID, 0, self.world.capacity, used_before=before, used_after=wk.used,
            free_before=free_before, free_after=free,
        )  # fmt: skip
        ack = AckFacts(
            task_id, ok, "sleep", wk.state, total_bytes=self.world.capacity,
            free_after_bytes=free, free_before_bytes=free_before, devices=(dev,),
            used_before_bytes=before, used_after_bytes=wk.used, **kw,  # type: ignore[arg-type]
        )  # fmt: skip
        wk.acks[task_id] = ack
        wk.last_ack = ack
        return ack

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
        self.calls.append(("sleep", stage))
        self.unresolved.add(stage)
        wk = self._check(stage)
        if task_id in wk.acks:
            ack = wk.acks[task_id]
        elif wk.state is WorkerPhase.FAILED:
            raise WorkerRefused("FAILED_PRECONDITION", "worker failed: residual above bound")
        elif wk.state is WorkerPhase.SLEEPING:
            raise WorkerUnavailable("deadline exceeded (still draining)")
        else:
            before, free_before = wk.used, self.world.free()
            outcome = self._outcome()
            dies = outcome.endswith("_die")
            outcome = outcome.removesuffix("_die")
            if wk.state is WorkerPhase.ASLEEP:
                outcome = "noop"  # already asleep: nothing moves (faults need memory to move)
            if outcome == "lost_before":
                raise WorkerUnavailable("deadline exceeded")
            if outcome == "refuse":
                raise WorkerRefused("FAILED_PRECONDITION", "level: 2 is not supported")
            if outcome == "slow_drain":
                wk.state, wk.inflight = WorkerPhase.SLEEPING, 1
                raise WorkerUnavailable("deadline exceeded while draining")
            if outcome == "not_ok":  # e.g. the drain timed out: the sleep was not started
                ack = self._ack(wk, task_id, False, before, free_before, error="drain timeout")
            elif outcome == "residual":  # memory left behind: FAILED, never Asleep
                wk.used = CONTEXT + max(UNIT, wk.weights // 2)
                wk.state = WorkerPhase.FAILED
                ack = self._ack(wk, task_id, False, before, free_before, error="residual")
            elif outcome == "lie":  # says ok and freed; the memory stays (device unchanged)
                wk.state, wk.level, wk.lied = WorkerPhase.ASLEEP, level, True
                claimed = before - CONTEXT
                ack = self._ack(wk, task_id, True, before, free_before, level=level,
                                freed_bytes=claimed)  # fmt: skip
            else:
                if wk.state is not WorkerPhase.ASLEEP:
                    wk.used = CONTEXT
                wk.state, wk.level = WorkerPhase.ASLEEP, max(level, wk.level)
                ack = self._ack(wk, task_id, True, before, free_before, level=wk.level,
                                freed_bytes=before - wk.used, noop=outcome == "noop")  # fmt: skip
            if outcome == "lost_after":
                raise WorkerUnavailable("deadline exceeded after the transition")
            if dies:
                raise OperatorDied(f"operator gone after {task_id}")
        if ack.ok:
            self.unresolved.discard(stage)
        return ack

    def _known_footprint(self, stage: str) -> int | None:
        w = self.world
        wk = w.workers[stage]
        known = [
            n
            for n in (w.intents[stage].vram_request, wk.measured_fp, wk.measured_peak,
                      w.learned.get(stage))
            if n
        ]  # fmt: skip
        return max(known) if known else None

    async def wake(self, stage: str, task_id: str) -> AckFacts:
        self.calls.append(("wake", stage))
        w = self.world
        wk = self._check(stage)
        if task_id in wk.acks:
            return wk.acks[task_id]
        if wk.state is WorkerPhase.FAILED:
            raise WorkerRefused("FAILED_PRECONDITION", "worker failed: residual above bound")
        others = self.unresolved - {stage}
        assert not others, f"wake of {stage} while {sorted(others)} lack an ok sleep ACK"
        if any(c[0] == "sleep" for c in self.calls):
            assert ("checkpoint", "") in self.calls, "wake before the sleep ACKs were published"
        for name, other in w.workers.items():
            # A co-tenant may hold memory only while it wants Active (it may be admitted beside
            # this stage: its share is counted, even while it does not answer), told no lie, is
            # not being fenced and has not failed; one that must release memory is covered by
            # the round's ACK check above (and a hung one that must, by its fence).
            honest_tenant = (
                w.intents[name].want_active
                and other.state is not WorkerPhase.FAILED
                and not other.lied
                and not w.fence_pending.get(name, False)
            )
            assert name == stage or other.beyond_context == 0 or honest_tenant, (
                f"WakeUp of {stage} while {name} may still hold {other.beyond_context} bytes "
                f"({other.state}, responsive={other.responsive}, lied={other.lied}, "
                f"fence pending={w.fence_pending.get(name, False)})"
            )
        if wk.state is WorkerPhase.ACTIVE:
            ack = AckFacts(task_id, True, "wake", WorkerPhase.ACTIVE, noop=True)
            wk.acks[task_id] = ack
            return ack
        free = w.free()
        if wk.weights > free:
            known = self._known_footprint(stage)
            assert known is None or known < wk.weights, (
                f"wake of {stage} refused for memory although its footprint {known} was known "
                f"({wk.weights} needed, {free} free)"
            )
            raise WorkerRefused(
                "RESOURCE_EXHAUSTED",
                f"not enough free device memory to wake: need {wk.weights} bytes, "
                f"{free} free of {w.capacity}",
            )
        wk.used = CONTEXT + wk.weights
        wk.state, wk.measured_fp, wk.measured_peak = WorkerPhase.ACTIVE, wk.used, wk.used
        ack = AckFacts(task_id, True, "wake", WorkerPhase.ACTIVE, freed_bytes=-wk.weights)
        wk.acks[task_id] = ack
        return ack

    async def checkpoint(self, outcome: RoundOutcome) -> None:
        self.calls.append(("checkpoint", ""))

    async def fence(self, stage: str, reason: str) -> None:
        self.calls.append(("fence", stage))
        w = self.world
        w.fence_pending[stage] = True  # the kube side persists a fence before it starts
        if stage in w.stuck_kubelet:
            raise FenceFailed(f"pod of {stage} not confirmed gone")
        wk = w.workers[stage]
        wk.pod, wk.alive, wk.used, wk.state, wk.lied = False, False, 0, WorkerPhase.ASLEEP, False
        wk.inflight = 0
        w.fence_pending[stage] = False
        self.unresolved.discard(stage)


class HandoverMachine(RuleBasedStateMachine):
    """Random specs, faults, serving, kubelet stalls and operator restarts on GPU physics."""

    def __init__(self) -> None:
        super().__init__()
        self.capacity = 0
        self.workers: dict[str, SimWorker] = {}
        self.intents: dict[str, StageIntent] = {}
        self.outcomes: list[str] = []
        self.created: set[str] = set()
        self.reached: set[str] = set()
        self.fence_pending: dict[str, bool] = {}  # persisted in status by the kube side
        self.learned: dict[str, int] = {}  # persisted in status by the kube side
        self.stuck_kubelet: set[str] = set()
        self.clock = itertools.count(1)
        self.ids = itertools.count(1)
        self.last: RoundOutcome | None = None
        self.measure_free = True

    def total_used(self) -> int:
        return sum(w.used for w in self.workers.values() if w.pod and w.alive)

    def free(self) -> int:
        return self.capacity - RESERVE - self.total_used()

    @initialize(
        capacity=st.integers(6, 24),
        stages=st.lists(
            st.tuples(
                st.integers(1, 8),  # weights (GiB)
                st.integers(0, 3),  # taken while serving, above the weights (GiB)
                st.sampled_from(["none", "exact", "over", "weights"]),  # vram.request
                st.integers(-2, 2),  # priority
                st.booleans(),  # wants Active
                st.sampled_from([1, 2]),
            ),
            min_size=1,
            max_size=4,
        ),
    )
    def setup(self, capacity: int, stages: list[tuple[int, int, str, int, bool, int]]) -> None:
        self.capacity = capacity * UNIT
        for i, (weights, extra, req, prio, want, level) in enumerate(stages):
            name = f"s{i}"
            peak = (weights + extra) * UNIT + CONTEXT
            request = {
                "none": None, "exact": peak, "over": peak + UNIT, "weights": weights * UNIT
            }[req]  # fmt: skip
            self.workers[name] = SimWorker(weights=weights * UNIT, extra=extra * UNIT)
            self.intents[name] = StageIntent(
                name, want, prio, float(next(self.clock)), level, request
            )

    def _round(self, outcomes: list[str]) -> SimPort:
        self.outcomes = list(outcomes)
        port = SimPort(self)
        policy = RoundPolicy(
            ack_retries=2, backoff_s=0.0, margin_bytes=MARGIN, transition_allowance_s=0.0,
            default_drain_timeout_s=0.0,
        )  # fmt: skip
        try:
            self.last = asyncio.run(run_round(port, policy, lambda: f"h{next(self.ids)}"))
        except OperatorDied:
            self.operator_restart()  # nothing of the round's bookkeeping survives
            return port
        # What the kube side persists in status after a round.
        self.learned.update(self.last.learned_needs)
        for name in self.last.fence_pending:
            self.fence_pending[name] = True
        return port

    @rule(outcomes=st.lists(SLEEP_OUTCOMES, max_size=6), measure_free=st.booleans())
    def round(self, outcomes: list[str], measure_free: bool) -> None:
        self.measure_free = measure_free
        self._round(outcomes)

    @rule(data=st.data())
    def toggle_wish(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.intents)))
        old = self.intents[name]
        at = float(next(self.clock)) if not old.want_active else old.requested_active_at
        self.intents[name] = StageIntent(
            name, not old.want_active, old.priority, at, old.sleep_level, old.vram_request
        )

    @rule(data=st.data(), priority=st.integers(-2, 2))
    def set_priority(self, data: st.DataObject, priority: int) -> None:
        name = data.draw(st.sampled_from(sorted(self.intents)))
        old = self.intents[name]
        self.intents[name] = StageIntent(
            name, old.want_active, priority, old.requested_active_at, old.sleep_level,
            old.vram_request,
        )  # fmt: skip

    @rule(data=st.data())
    def serve(self, data: st.DataObject) -> None:
        """Requests take activations and pools above the weights; kept until the sleep."""
        wk = self.workers[data.draw(st.sampled_from(sorted(self.workers)))]
        if wk.pod and wk.alive and wk.state is WorkerPhase.ACTIVE and not wk.lied:
            want = CONTEXT + wk.weights + wk.extra
            wk.used = max(wk.used, min(want, wk.used + self.free()))  # beyond: the request OOMs
            wk.measured_peak = max(wk.measured_peak or 0, wk.used)

    @rule(data=st.data())
    def crash(self, data: st.DataObject) -> None:
        wk = self.workers[data.draw(st.sampled_from(sorted(self.workers)))]
        if wk.pod:
            wk.alive, wk.used, wk.inflight = False, 0, 0

    @rule(data=st.data())
    def hang(self, data: st.DataObject) -> None:
        wk = self.workers[data.draw(st.sampled_from(sorted(self.workers)))]
        if wk.pod and wk.alive:
            wk.responsive = False  # keeps its memory

    @rule(data=st.data())
    def container_restart(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.workers)))
        wk = self.workers[name]
        if wk.pod and not (wk.alive and wk.responsive):
            # The pod was built with --initial-state asleep: the new process holds its context
            # (the old one's memory is freed when it ends).
            wk.alive, wk.responsive, wk.state, wk.used = False, True, WorkerPhase.ASLEEP, 0
            wk.alive = self.free() >= CONTEXT
            wk.used = CONTEXT if wk.alive else 0
            wk.lied, wk.inflight, wk.last_ack, wk.acks = False, 0, None, {}
            wk.level = self.intents[name].sleep_level

    @rule(data=st.data())
    def sleep_in_progress(self, data: st.DataObject) -> None:
        """A sleep sent by an earlier operator is still running: Sleeping, memory still held."""
        wk = self.workers[data.draw(st.sampled_from(sorted(self.workers)))]
        if wk.pod and wk.alive and wk.responsive and wk.state is WorkerPhase.ACTIVE:
            wk.state = WorkerPhase.SLEEPING

    @rule()
    def transitions_finish(self) -> None:
        for wk in self.workers.values():
            if wk.state is WorkerPhase.SLEEPING:
                wk.state, wk.inflight = WorkerPhase.ASLEEP, 0
                wk.used = CONTEXT if wk.alive else 0

    @rule(data=st.data())
    def kubelet_stuck(self, data: st.DataObject) -> None:
        """Deleting this stage's pod is never confirmed (until the kubelet recovers)."""
        self.stuck_kubelet.add(data.draw(st.sampled_from(sorted(self.workers))))

    @rule()
    def kubelet_recovers(self) -> None:
        self.stuck_kubelet.clear()

    @rule()
    def operator_restart(self) -> None:
        """Everything in the operator's memory is gone; status (pending fences, learned needs)
        and the workers' own figures remain."""
        self.created.clear()
        self.reached.clear()

    def _fits_alone(self, name: str) -> bool:
        wk = self.workers[name]
        need = max(self.intents[name].vram_request or 0, CONTEXT + wk.weights + wk.extra)
        others = CONTEXT * (len(self.workers) - 1)
        return need + CONTEXT + others + RESERVE + MARGIN <= self.capacity

    @precondition(lambda self: bool(self.workers))
    @rule()
    def settle(self) -> None:
        """Faults stop: the group converges to the admitted set and stays there."""
        self.measure_free = True
        self.stuck_kubelet.clear()
        self.transitions_finish()
        for name, wk in self.workers.items():
            if wk.pod and not (wk.alive and wk.responsive):
                wk.responsive, wk.alive, wk.used = True, False, 0  # the old process ends
                wk.alive = self.free() >= CONTEXT
                wk.state, wk.used = WorkerPhase.ASLEEP, CONTEXT if wk.alive else 0
                wk.lied, wk.inflight, wk.last_ack, wk.acks = False, 0, None, {}
                wk.level = self.intents[name].sleep_level
        # Each round may learn a need (a refused wake) that lets the next stage in: converge
        # until a round moves nothing (bounded).
        for _ in range(20):
            for name, wk in self.workers.items():  # a container that died at start is rerun
                if wk.pod and not wk.alive and self.free() >= CONTEXT:
                    wk.alive, wk.responsive, wk.used = True, True, CONTEXT
                    wk.state, wk.level = WorkerPhase.ASLEEP, self.intents[name].sleep_level
                    wk.lied, wk.inflight, wk.last_ack, wk.acks = False, 0, None, {}
            port = self._round([])
            if not [c for c in port.calls if c[0] in ("sleep", "wake", "fence", "start")]:
                break
        assert self.last is not None and self.last.decision is not None
        decision = self.last.decision
        admitted = set(decision.admitted)
        for name, wk in self.workers.items():
            holds = wk.beyond_context > 0
            assert not holds or name in admitted, (name, wk.state, sorted(admitted))
            if name in admitted and not holds:
                reasons = {b.reason for b in decision.waiting.get(name, ())}
                assert reasons & {BlockReason.FREE_TOO_LOW}, (name, wk.state, reasons)
        for name in admission_order(self.intents):
            if self._fits_alone(name):
                assert self.workers[name].state is WorkerPhase.ACTIVE, (
                    f"{name} wants Active, fits and comes first, yet is "
                    f"{self.workers[name].state}: {decision.waiting.get(name)}"
                )
            break
        port = self._round([])
        moves = [c for c in port.calls if c[0] in ("sleep", "wake", "fence", "start")]
        assert not moves, f"converged group still moves: {moves}"

    @invariant()
    def memory_within_capacity(self) -> None:
        assert self.total_used() + RESERVE <= self.capacity


HandoverMachine.TestCase.settings = settings(
    max_examples=500,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestHandover = HandoverMachine.TestCase


def _machine(capacity: int, stages: list[tuple[int, str, int, bool, int]]) -> HandoverMachine:
    m = HandoverMachine()
    m.capacity = capacity * UNIT
    for i, (weights, req, prio, want, level) in enumerate(stages):
        request = {"none": None, "exact": weights * UNIT + CONTEXT}[req]
        m.workers[f"s{i}"] = SimWorker(weights=weights * UNIT, extra=0)
        m.intents[f"s{i}"] = StageIntent(f"s{i}", want, prio, float(i + 1), level, request)
    return m


def _wish(m: HandoverMachine, name: str, want: bool) -> None:
    old = m.intents[name]
    m.intents[name] = StageIntent(
        name, want, old.priority, float(next(m.clock)) + 100, old.sleep_level, old.vram_request
    )


def test_hung_holder_is_fenced_and_without_free_figures_nothing_wakes() -> None:
    """Issue 14: the wake gate fails closed. (It used to wake s1 in the round without free
    figures, trusting the fence alone.)"""
    m = _machine(8, [(3, "exact", 0, True, 1), (3, "exact", 0, False, 1)])
    m._round([])
    m._round([])
    assert m.workers["s0"].state is WorkerPhase.ACTIVE
    m.workers["s0"].responsive = False  # hung, still holding 3 MiB
    _wish(m, "s0", False)
    _wish(m, "s1", True)
    m.measure_free = False
    port = m._round([])
    assert ("fence", "s0") in port.calls
    assert ("wake", "s1") not in port.calls
    assert m.last is not None and m.last.decision is not None
    assert m.last.decision.waiting["s1"][0].reason is BlockReason.NOT_MEASURED
    m.measure_free = True
    port = m._round([])
    assert port.calls == [("start", "s0")]  # the fenced stage comes back asleep; no wake now
    port = m._round([])
    assert ("wake", "s1") in port.calls
    assert m.workers["s1"].state is WorkerPhase.ACTIVE
    assert m.total_used() <= m.capacity


def test_not_ok_sleep_ack_is_retried_under_a_new_id_then_fenced() -> None:
    """Issue 14: the worker caches a not-ok Ack under its task id, so a retry under the same id
    only replays it; the retry goes under a new id (it used to reuse the id, and fence)."""
    m = _machine(8, [(3, "exact", 0, True, 1), (3, "exact", 0, False, 2)])
    m._round([])
    m._round([])
    _wish(m, "s0", False)
    _wish(m, "s1", True)
    port = m._round(["not_ok"])  # the retry's new id gets a fresh, ok, sleep
    assert m.last is not None and m.last.sleeps[0].ok
    ids = m.last.sleeps[0].task_ids
    assert len(ids) == 2 and ids[0] != ids[1]
    assert ("fence", "s0") not in port.calls
    assert m.workers["s1"].state is WorkerPhase.ACTIVE

    m = _machine(8, [(3, "exact", 0, True, 1), (3, "exact", 0, False, 2)])
    m._round([])
    m._round([])
    _wish(m, "s0", False)
    _wish(m, "s1", True)
    port = m._round(["not_ok", "not_ok"])
    assert port.calls.count(("sleep", "s0")) == 2
    assert port.calls.index(("fence", "s0")) < port.calls.index(("wake", "s1"))
    assert m.workers["s1"].state is WorkerPhase.ACTIVE


def test_lost_ack_after_transition_is_recovered_by_the_retry() -> None:
    m = _machine(8, [(3, "exact", 0, True, 1), (3, "exact", 0, False, 1)])
    m._round([])
    m._round([])
    _wish(m, "s0", False)
    _wish(m, "s1", True)
    port = m._round(["lost_after"])
    assert ("fence", "s0") not in port.calls
    assert m.workers["s0"].state is WorkerPhase.ASLEEP
    assert m.workers["s1"].state is WorkerPhase.ACTIVE


def test_sleep_in_progress_is_awaited_before_the_wake() -> None:
    m = _machine(8, [(3, "exact", 0, True, 1), (3, "exact", 0, False, 1)])
    m._round([])
    m._round([])
    m.workers["s0"].state = WorkerPhase.SLEEPING  # an earlier operator's sleep, still running
    _wish(m, "s0", False)
    _wish(m, "s1", True)
    m.measure_free = False
    port = m._round([])
    assert ("wake", "s1") not in port.calls and ("sleep", "s0") not in port.calls
    m.transitions_finish()
    port = m._round([])
    assert ("wake", "s1") not in port.calls  # no free figures: the gate stays closed (issue 14)
    m.measure_free = True
    port = m._round([])
    assert ("wake", "s1") in port.calls
    assert m.total_used() <= m.capacity
