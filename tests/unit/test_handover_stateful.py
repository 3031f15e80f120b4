"""Property-based tests of the arbiter driven through the real hand-over round.

``run_round`` (operator/src/omnistage_operator/handover.py) runs against a simulated fleet: a
port whose workers keep the *true* memory they hold, answer sleeps with ok / not-ok ACKs, lose
ACKs (timeouts before or after the transition), crash, hang, restart their container, and an
operator that restarts (forgets everything it had in memory). The simulator is the only fake
here: it is the one way to cause these faults at random, thousands of times.

Invariants:
- never a wake while a stage told to sleep in this round lacks an ok ACK or a confirmed fence;
- the true memory of all processes never exceeds the capacity (checked at every wake);
- after faults stop, every admitted stage is Active, every other stage holds nothing, and the
  first stage in admission order (priority, latest ask) that fits is Active;
- once converged with unchanged specs, a further round orders no sleep and no wake.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from omnistage_operator.arbiter import (
    BlockReason,
    GroupMemory,
    StageFacts,
    StageIntent,
    WorkerPhase,
    admission_order,
)
from omnistage_operator.facts import AckFacts
from omnistage_operator.handover import (
    GroupObservation,
    RoundOutcome,
    RoundPolicy,
    WorkerUnavailable,
    run_round,
)

MI = 1 << 20
SLEEP_OUTCOMES = st.sampled_from(["ok", "ok", "ok", "not_ok", "lost_before", "lost_after"])


@dataclass
class SimWorker:
    """One stage's pod and process, with the memory it truly holds."""

    true_fp: int
    pod: bool = False
    alive: bool = False
    responsive: bool = True
    state: WorkerPhase = WorkerPhase.ASLEEP
    level: int = 1
    used: int = 0
    measured_fp: int | None = None
    acks: dict[str, AckFacts] = field(default_factory=dict)


class SimPort:
    """A ``GroupPort`` over simulated workers; checks the promise at every wake."""

    def __init__(self, world: HandoverMachine) -> None:
        self.world = world
        self.calls: list[tuple[str, str]] = []
        self.unresolved: set[str] = set()  # told to sleep this round, no ok ACK, not fenced

    def _outcome(self) -> str:
        outcomes = self.world.outcomes
        return outcomes.pop(0) if outcomes else "ok"

    async def observe(self) -> GroupObservation:
        w = self.world
        facts: dict[str, StageFacts] = {}
        free: int | None = None
        for name, wk in w.workers.items():
            if not wk.pod:
                facts[name] = StageFacts(WorkerPhase.ABSENT)
            elif wk.alive and wk.responsive:
                w.reached.add(name)
                facts[name] = StageFacts(
                    wk.state,
                    level=wk.level if wk.state is WorkerPhase.ASLEEP else None,
                    used_bytes=wk.used,
                    active_footprint=wk.measured_fp,
                )
                free = w.capacity - w.total_used()
            elif name in w.created and name not in w.reached:
                facts[name] = StageFacts(WorkerPhase.STARTING)
            else:
                facts[name] = StageFacts(WorkerPhase.UNREACHABLE)
        if free is not None and not w.measure_free:
            # Exercise the holder/ACK rules alone: the measured-free gate would also catch a
            # holder the rules missed, since the simulated device figure is always true.
            free = None
            return GroupObservation(dict(w.intents), facts, GroupMemory(w.capacity, None))
        memory = GroupMemory(w.capacity if free is not None else None, free)
        return GroupObservation(dict(w.intents), facts, memory)

    async def start(self, stage: str) -> None:
        wk = self.world.workers[stage]
        assert not wk.pod, f"start of {stage} whose pod exists"
        wk.pod, wk.alive, wk.responsive = True, True, True
        wk.state, wk.used, wk.level = WorkerPhase.ASLEEP, 0, self.world.intents[stage].sleep_level
        self.world.created.add(stage)
        self.world.reached.discard(stage)
        self.calls.append(("start", stage))

    def _check(self, stage: str) -> SimWorker:
        wk = self.world.workers[stage]
        if not (wk.pod and wk.alive and wk.responsive):
            raise WorkerUnavailable(f"{stage} does not answer")
        return wk

    async def probe(self, stage: str) -> StageFacts:
        return (await self.observe()).facts[stage]

    async def sleep(
        self,
        stage: str,
        level: int,
        task_id: str,
        *,
        drain_timeout_s: float | None = None,
        timeout_s: float | None = None,
    ) -> AckFacts:
        self.calls.append(("sleep", stage))
        self.unresolved.add(stage)
        wk = self._check(stage)
        if task_id in wk.acks:
            ack = wk.acks[task_id]
        else:
            outcome = self._outcome()
            if outcome == "lost_before":
                raise WorkerUnavailable("deadline exceeded")
            if outcome == "not_ok":
                ack = AckFacts(task_id, False, "sleep", wk.state, error="residual too high")
            else:
                wk.state, wk.used, wk.level = WorkerPhase.ASLEEP, 0, level
                ack = AckFacts(task_id, True, "sleep", WorkerPhase.ASLEEP, level=level)
            wk.acks[task_id] = ack
            if outcome == "lost_after":
                raise WorkerUnavailable("deadline exceeded after the transition")
        if ack.ok:
            self.unresolved.discard(stage)
        return ack

    async def wake(self, stage: str, task_id: str) -> AckFacts:
        self.calls.append(("wake", stage))
        wk = self._check(stage)
        if task_id in wk.acks:
            return wk.acks[task_id]
        others = self.unresolved - {stage}
        assert not others, f"wake of {stage} while {sorted(others)} lack an ok sleep ACK"
        if any(c[0] == "sleep" for c in self.calls):
            assert ("checkpoint", "") in self.calls, "wake before the sleep ACKs were published"
        if wk.state is not WorkerPhase.ACTIVE:
            total = self.world.total_used() - wk.used + wk.true_fp
            assert total <= self.world.capacity, (
                f"wake of {stage} puts {total} bytes on a {self.world.capacity}-byte device"
            )
        wk.state, wk.used, wk.measured_fp = WorkerPhase.ACTIVE, wk.true_fp, wk.true_fp
        ack = AckFacts(task_id, True, "wake", WorkerPhase.ACTIVE)
        wk.acks[task_id] = ack
        return ack

    async def checkpoint(self, outcome: RoundOutcome) -> None:
        self.calls.append(("checkpoint", ""))

    async def fence(self, stage: str, reason: str) -> None:
        self.calls.append(("fence", stage))
        wk = self.world.workers[stage]
        wk.pod, wk.alive, wk.used, wk.state = False, False, 0, WorkerPhase.ASLEEP
        self.unresolved.discard(stage)


class HandoverMachine(RuleBasedStateMachine):
    """Random specs, ACK outcomes, crashes, hangs, sleeps in progress and operator restarts."""

    def __init__(self) -> None:
        super().__init__()
        self.capacity = 0
        self.workers: dict[str, SimWorker] = {}
        self.intents: dict[str, StageIntent] = {}
        self.outcomes: list[str] = []
        self.created: set[str] = set()
        self.reached: set[str] = set()
        self.clock = itertools.count(1)
        self.ids = itertools.count(1)
        self.last: RoundOutcome | None = None
        self.measure_free = True

    def total_used(self) -> int:
        return sum(w.used for w in self.workers.values() if w.pod and w.alive)

    @initialize(
        capacity=st.integers(4, 16),
        stages=st.lists(
            st.tuples(
                st.integers(1, 10),  # true footprint (MiB)
                st.sampled_from(["none", "exact", "over"]),  # vram.request
                st.integers(-2, 2),  # priority
                st.booleans(),  # wants Active
                st.sampled_from([1, 2]),
            ),
            min_size=1,
            max_size=4,
        ),
    )
    def setup(self, capacity: int, stages: list[tuple[int, str, int, bool, int]]) -> None:
        self.capacity = capacity * MI
        for i, (drawn_fp, req, prio, want, level) in enumerate(stages):
            name = f"s{i}"
            fp = min(drawn_fp, capacity)  # a stage bigger than the device OOMs on its own
            request = {"none": None, "exact": fp * MI, "over": (fp + 1) * MI}[req]
            self.workers[name] = SimWorker(true_fp=fp * MI)
            self.intents[name] = StageIntent(
                name, want, prio, float(next(self.clock)), level, request
            )

    def _round(self, outcomes: list[str]) -> SimPort:
        self.outcomes = list(outcomes)
        port = SimPort(self)
        policy = RoundPolicy(ack_retries=2, backoff_s=0.0)
        self.last = asyncio.run(run_round(port, policy, lambda: f"h{next(self.ids)}"))
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
    def crash(self, data: st.DataObject) -> None:
        wk = self.workers[data.draw(st.sampled_from(sorted(self.workers)))]
        if wk.pod:
            wk.alive, wk.used = False, 0

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
            # The pod was built with --initial-state asleep, so the new process holds nothing.
            wk.alive, wk.responsive, wk.state, wk.used = True, True, WorkerPhase.ASLEEP, 0
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
                wk.state, wk.used = WorkerPhase.ASLEEP, 0

    @rule()
    def operator_restart(self) -> None:
        self.created.clear()
        self.reached.clear()

    @precondition(lambda self: bool(self.workers))
    @rule()
    def settle(self) -> None:
        """Faults stop: the group converges to the admitted set and stays there."""
        self.measure_free = True
        self.transitions_finish()
        for name, wk in self.workers.items():
            if wk.pod and not (wk.alive and wk.responsive):
                wk.alive, wk.responsive, wk.state, wk.used = True, True, WorkerPhase.ASLEEP, 0
                wk.level = self.intents[name].sleep_level
        for _ in range(4):
            self._round([])
        assert self.last is not None and self.last.decision is not None
        admitted = set(self.last.decision.admitted)
        for name, wk in self.workers.items():
            holds = wk.pod and wk.alive and wk.state is not WorkerPhase.ASLEEP
            assert holds == (name in admitted), (name, wk.state, sorted(admitted))
        for name in admission_order(self.intents):
            if (
                self.workers[name].true_fp <= self.capacity
                and (self.intents[name].vram_request or 0) <= self.capacity
            ):
                assert self.workers[name].state is WorkerPhase.ACTIVE, (
                    f"{name} wants Active, fits and comes first, yet is {self.workers[name].state}"
                )
            break
        port = self._round([])
        moves = [c for c in port.calls if c[0] in ("sleep", "wake", "fence")]
        assert not moves, f"converged group still moves: {moves}"

    @invariant()
    def memory_within_capacity(self) -> None:
        assert self.total_used() <= self.capacity


HandoverMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestHandover = HandoverMachine.TestCase


def _machine(capacity_mi: int, stages: list[tuple[int, str, int, bool, int]]) -> HandoverMachine:
    m = HandoverMachine()
    m.capacity = capacity_mi * MI
    for i, (fp, req, prio, want, level) in enumerate(stages):
        request = {"none": None, "exact": fp * MI}[req]
        m.workers[f"s{i}"] = SimWorker(true_fp=fp * MI)
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
    m = _machine(4, [(3, "exact", 0, True, 1), (3, "exact", 0, False, 1)])
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
    m = _machine(4, [(3, "exact", 0, True, 1), (3, "exact", 0, False, 2)])
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

    m = _machine(4, [(3, "exact", 0, True, 1), (3, "exact", 0, False, 2)])
    m._round([])
    m._round([])
    _wish(m, "s0", False)
    _wish(m, "s1", True)
    port = m._round(["not_ok", "not_ok"])
    assert port.calls.count(("sleep", "s0")) == 2
    assert port.calls.index(("fence", "s0")) < port.calls.index(("wake", "s1"))
    assert m.workers["s1"].state is WorkerPhase.ACTIVE


def test_lost_ack_after_transition_is_recovered_by_the_retry() -> None:
    m = _machine(4, [(3, "exact", 0, True, 1), (3, "exact", 0, False, 1)])
    m._round([])
    m._round([])
    _wish(m, "s0", False)
    _wish(m, "s1", True)
    port = m._round(["lost_after"])
    assert ("fence", "s0") not in port.calls
    assert m.workers["s0"].state is WorkerPhase.ASLEEP
    assert m.workers["s1"].state is WorkerPhase.ACTIVE


def test_sleep_in_progress_is_awaited_before_the_wake() -> None:
    m = _machine(4, [(3, "exact", 0, True, 1), (3, "exact", 0, False, 1)])
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
