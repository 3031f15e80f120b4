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
``memory.group_memory``), and persists what the kube side persists. Half the fleets run
overlapped hand-overs (``RoundPolicy.overlapped``, on ``overlap_sim.OverlapSimPort``: a wake
beside a sleep takes each piece only when its limit allows it and the device has it); the same
invariants hold for them.

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

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from omnistage_operator.decisions.arbiter import BlockReason, StageIntent, WorkerPhase
from omnistage_operator.decisions.arbiter.admission import admission_order
from omnistage_operator.decisions.handover import RoundOutcome, RoundPolicy
from omnistage_operator.decisions.handover.rounds import run_round
from tests.unit.handover_sim import CONTEXT, RESERVE, UNIT, OperatorDied, SimPort, SimWorker
from tests.unit.overlap_sim import OverlapSimPort

MARGIN = 0
SLEEP_OUTCOMES = st.sampled_from(
    ["ok", "ok", "ok", "not_ok", "lost_before", "lost_after", "residual", "lie", "refuse",
     "slow_drain", "residual_die", "lie_die", "ok_die"]
)  # fmt: skip


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
        self.overlapped = False  # overlapped hand-overs (RoundPolicy.overlapped), on OverlapSimPort

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
        overlapped=st.booleans(),
    )
    def setup(
        self, capacity: int, stages: list[tuple[int, int, str, int, bool, int]], overlapped: bool
    ) -> None:
        self.capacity = capacity * UNIT
        self.overlapped = overlapped
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
        port = OverlapSimPort(self) if self.overlapped else SimPort(self)
        policy = RoundPolicy(
            ack_retries=2, backoff_s=0.0, margin_bytes=MARGIN, transition_allowance_s=0.0,
            default_drain_timeout_s=0.0, overlapped=self.overlapped,
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
