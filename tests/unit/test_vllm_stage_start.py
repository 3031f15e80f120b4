"""A vLLM stage's pod starts asleep, pre-warmed at level 2 (issue 23): nothing on the device until
its first wake starts the engine, so it is charged what its engine will take before it ever
ran, and that wake goes through the gate like any other; a failed first wake backs off and the
group hands over meanwhile. One stage's error never blocks the other stages of its group.

``GroupSim`` is a port over a simulated group on one device: a stage holds its bytes while
Active, nothing while asleep or absent. It checks the promise at every wake: the measured free
memory covers the stage.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omnistage_operator.decisions.arbiter import (
    BlockReason,
    DeviceMemory,
    GroupMemory,
    StageFacts,
    StageIntent,
    WorkerPhase,
)
from omnistage_operator.decisions.arbiter.plan import plan
from omnistage_operator.decisions.facts import AckFacts
from omnistage_operator.decisions.handover import GroupObservation, RoundOutcome, RoundPolicy
from omnistage_operator.decisions.handover.rounds import run_round
from omnistage_operator.decisions.wake_backoff import (
    FIRST_S,
    MAX_S,
    WakeBackoff,
    failure_message,
)

GI = 1 << 30
TOTAL = 16 * GI
POLICY = RoundPolicy(ack_retries=2, backoff_s=0.01)
ENGINE_FAILS = "No available memory for the cache blocks"


@dataclass
class Stage:
    intent: StageIntent
    phase: WorkerPhase
    holds: int  # bytes while Active
    level: int = 1


@dataclass
class GroupSim:
    stages: dict[str, Stage]
    calls: list[tuple[str, str]] = field(default_factory=list)
    broken_start: set[str] = field(default_factory=set)
    engine_fails: set[str] = field(default_factory=set)  # its engine cannot start

    def _free(self) -> int:
        held = sum(s.holds for s in self.stages.values() if s.phase is WorkerPhase.ACTIVE)
        return TOTAL - held

    async def observe(self) -> GroupObservation:
        facts = {
            n: StageFacts(
                s.phase,
                level=s.level if s.phase is WorkerPhase.ASLEEP else None,
                used_bytes=s.holds if s.phase is WorkerPhase.ACTIVE else 0,
                device_uuids=("GPU-0",) if s.phase is not WorkerPhase.ABSENT else (),
            )
            for n, s in self.stages.items()
        }
        free = self._free()
        mem = GroupMemory(TOTAL, free, (DeviceMemory("GPU-0", TOTAL, free),))
        return GroupObservation({n: s.intent for n, s in self.stages.items()}, facts, mem)

    async def probe(self, stage: str) -> StageFacts:
        return (await self.observe()).facts[stage]

    async def start(self, stage: str) -> None:
        self.calls.append(("start", stage))
        if stage in self.broken_start:
            raise RuntimeError(f"API refused the pod of {stage}")
        s = self.stages[stage]
        s.phase = WorkerPhase.ASLEEP  # pre-warmed: nothing on the device
        s.level = 2

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
        self.stages[stage].phase = WorkerPhase.ASLEEP
        self.stages[stage].level = level
        return AckFacts(task_id, True, "sleep", WorkerPhase.ASLEEP, level=level)

    async def wake(self, stage: str, task_id: str) -> AckFacts:
        self.calls.append(("wake", stage))
        s = self.stages[stage]
        assert self._free() >= s.holds, "woken into memory another stage holds"
        if stage in self.engine_fails:  # the worker stops what started: asleep at 2 again
            error = f"wake from level 2 failed: {ENGINE_FAILS}"
            return AckFacts(task_id, False, "wake", WorkerPhase.ASLEEP, level=2, error=error)
        s.phase = WorkerPhase.ACTIVE
        return AckFacts(task_id, True, "wake", WorkerPhase.ACTIVE)

    async def fence(self, stage: str, reason: str) -> None:
        self.calls.append(("fence", stage))
        self.stages[stage].phase = WorkerPhase.ABSENT

    async def checkpoint(self, outcome: RoundOutcome) -> None:
        return None


def _vllm(want: bool = True, at: float = 2.0, request: int | None = 10 * GI) -> StageIntent:
    return StageIntent("llm", want, requested_active_at=at, vram_request=request)


def _torch(want: bool = True, at: float = 1.0) -> StageIntent:
    return StageIntent("dit", want, requested_active_at=at, vram_request=10 * GI)


PREWARMED = StageFacts(WorkerPhase.ASLEEP, level=2, device_uuids=("GPU-0",))


# -- the arbiter ---------------------------------------------------------------------------


def test_a_prewarmed_vllm_stage_is_woken_only_when_free_covers_its_engine() -> None:
    """Asleep at level 2 it holds nothing, yet its first wake starts an engine that takes its
    request: the gate charges that, not what it holds now."""
    mem = GroupMemory(TOTAL, TOTAL, (DeviceMemory("GPU-0", TOTAL, TOTAL),))
    d = plan({"llm": _vllm()}, {"llm": PREWARMED}, mem)
    assert d.wake == ("llm",) and d.footprints["llm"] == 10 * GI

    low = GroupMemory(TOTAL, 6 * GI, (DeviceMemory("GPU-0", TOTAL, 6 * GI),))
    d = plan({"llm": _vllm()}, {"llm": PREWARMED}, low)
    assert d.wake == ()
    assert d.waiting["llm"][0].reason is BlockReason.FREE_TOO_LOW


def test_gpu_memory_utilization_is_a_floor_of_the_footprint() -> None:
    """Without vram.request, a vLLM stage's engine takes gpuMemoryUtilization of the device:
    its first wake is not sent into less free memory than that (its engine would not start)."""
    intent = StageIntent("llm", True, memory_share=0.5)
    low = GroupMemory(TOTAL, 6 * GI, (DeviceMemory("GPU-0", TOTAL, 6 * GI),))
    d = plan({"llm": intent}, {"llm": PREWARMED}, low)
    assert d.footprints["llm"] == 8 * GI and d.wake == ()
    assert d.waiting["llm"][0].reason is BlockReason.FREE_TOO_LOW
    enough = GroupMemory(TOTAL, 9 * GI, (DeviceMemory("GPU-0", TOTAL, 9 * GI),))
    assert plan({"llm": intent}, {"llm": PREWARMED}, enough).wake == ("llm",)


def test_the_holder_sleeps_before_a_prewarmed_vllm_stage_wakes() -> None:
    mem = GroupMemory(TOTAL, 6 * GI, (DeviceMemory("GPU-0", TOTAL, 6 * GI),))
    intents = {"llm": _vllm(), "dit": _torch()}
    active = StageFacts(WorkerPhase.ACTIVE, used_bytes=10 * GI, device_uuids=("GPU-0",))
    d = plan(intents, {"llm": PREWARMED, "dit": active}, mem)
    assert d.admitted == ("llm",) and [o.stage for o in d.sleep] == ["dit"] and d.wake == ()


# -- the round -----------------------------------------------------------------------------


async def test_round_hands_over_from_a_torch_stage_to_a_vllm_stage_and_back() -> None:
    """Its pod is created asleep before it is asked (nothing on the device); the hand-over to
    it is a sleep of the torch stage, then a wake of the running vLLM pod."""
    sim = GroupSim(
        {
            "llm": Stage(_vllm(want=False), WorkerPhase.ABSENT, 10 * GI),
            "dit": Stage(_torch(), WorkerPhase.ACTIVE, 10 * GI),
        }
    )
    out = await run_round(sim, POLICY, lambda: "h0")
    assert sim.calls == [("start", "llm")] and out.started == ["llm"]
    assert sim.stages["llm"].level == 2 and sim._free() == TOTAL - 10 * GI

    sim.stages["llm"].intent = _vllm(at=2.0)
    sim.calls.clear()
    await run_round(sim, POLICY, lambda: "h1")
    assert sim.calls == [("sleep", "dit"), ("wake", "llm")]

    sim.stages["llm"].intent = _vllm(want=False)
    sim.stages["dit"].intent = _torch(at=3.0)
    sim.calls.clear()
    await run_round(sim, POLICY, lambda: "h2")
    assert sim.calls == [("sleep", "llm"), ("wake", "dit")]


async def test_a_failed_first_wake_is_the_stages_own() -> None:
    """The engine cannot start: the ACK is not ok with the engine's words, the worker is
    asleep at level 2 again, and nothing else of the round is affected."""
    sim = GroupSim({"llm": Stage(_vllm(), WorkerPhase.ASLEEP, 10 * GI, level=2)})
    sim.engine_fails.add("llm")
    out = await run_round(sim, POLICY, lambda: "h1")
    assert ENGINE_FAILS in out.wake_errors["llm"] and not out.wakes["llm"].ok
    assert "llm" not in out.wake_oom and not out.stage_errors
    assert sim.stages["llm"].phase is WorkerPhase.ASLEEP


def test_failed_wakes_back_off_doubling_up_to_the_cap() -> None:
    """The kube side holds a stage's wakes while this back-off runs (``_hold_wakes``), so the
    group's other stages are admitted meanwhile; a wake that goes through ends it."""
    ack = AckFacts("h1-llm-wake", False, "wake", WorkerPhase.ASLEEP, level=2, error=ENGINE_FAILS)
    backoff = WakeBackoff()
    waits = []
    for _ in range(8):
        backoff = backoff.after_failure(100.0)
        waits.append(backoff.left(100.0))
    assert waits[:3] == [FIRST_S, 2 * FIRST_S, 4 * FIRST_S] and waits[-1] == MAX_S
    assert backoff.needed_bytes == 0
    message = failure_message(ack, WakeBackoff().after_failure(100.0), 100.0)
    assert ENGINE_FAILS in message and "back asleep at level 2" in message


async def test_one_stage_failing_to_start_does_not_block_the_group() -> None:
    """Today's round raised on the first start error: no stage of the group moved."""
    sim = GroupSim(
        {
            "a-broken": Stage(StageIntent("a-broken", False), WorkerPhase.ABSENT, GI),
            "dit": Stage(_torch(), WorkerPhase.ASLEEP, 10 * GI),
        },
        broken_start={"a-broken"},
    )
    out = await run_round(sim, POLICY, lambda: "h1")
    assert "API refused the pod of a-broken" in out.stage_errors["a-broken"]
    assert ("wake", "dit") in sim.calls and out.wakes["dit"].ok
