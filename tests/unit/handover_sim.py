"""A simulated fleet on one simulated GPU for test_handover_stateful.py: each stage's pod and
process with the memory it truly holds, and a ``GroupPort`` over them that plays the faults it is
given and checks the operator's promise at every wake."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from omnistage_operator.decisions.arbiter import GroupMemory, StageFacts, StageIntent, WorkerPhase
from omnistage_operator.decisions.facts import AckFacts, DeviceFigures, WorkerReport
from omnistage_operator.decisions.handover import (
    FenceFailed,
    GroupObservation,
    RoundOutcome,
    WorkerRefused,
    WorkerUnavailable,
)
from omnistage_operator.decisions.memory import group_memory

MI = 1 << 20
GI = 1 << 30
UNIT = GI  # sizes are drawn in GiB (an ACK's lie must exceed max(2% of total, 256 MiB))
RESERVE = 512 * MI  # the driver's reserve: never free
CONTEXT = 612 * MI  # a process's CUDA context (H100, LIMITS.md), held while it lives
UUID = "GPU-sim-0"


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


class SimWorld(Protocol):
    """The fleet a ``SimPort`` reads and changes: its workers, their intents and what the kube
    side persists (``HandoverMachine`` in test_handover_stateful.py)."""

    capacity: int
    workers: dict[str, SimWorker]
    intents: dict[str, StageIntent]
    outcomes: list[str]  # the next sleeps' outcomes, in order ("ok" once used up)
    created: set[str]
    reached: set[str]
    fence_pending: dict[str, bool]
    learned: dict[str, int]
    stuck_kubelet: set[str]
    measure_free: bool

    def free(self) -> int: ...


class SimPort:
    """A ``GroupPort`` over simulated workers on one simulated GPU; checks the promise."""

    def __init__(self, world: SimWorld) -> None:
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

    async def start(self, stage: str) -> None:
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
