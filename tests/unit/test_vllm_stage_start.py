"""vLLM stages start only once admitted and covered by the measured free memory (issue 9), and
one stage's error never blocks the other stages of its group.

``GroupSim`` is a port over a simulated group on one device: a stage holds its bytes while
Active or starting Active, nothing while asleep or absent. It checks the promise at every
Active start and wake: the measured free memory covers the stage.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime

from omnistage_operator.api import conditions as cond
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
from omnistage_operator.decisions.status import Phase, StageObservation, build_status

GI = 1 << 30
TOTAL = 16 * GI
POLICY = RoundPolicy(ack_retries=2, backoff_s=0.01)


@dataclass
class Stage:
    intent: StageIntent
    phase: WorkerPhase
    holds: int  # bytes while Active (or starting Active)


@dataclass
class GroupSim:
    stages: dict[str, Stage]
    calls: list[tuple[str, str]] = field(default_factory=list)
    broken_start: set[str] = field(default_factory=set)

    def _free(self) -> int:
        held = sum(
            s.holds
            for s in self.stages.values()
            if s.phase in (WorkerPhase.ACTIVE, WorkerPhase.LOADING)
        )
        return TOTAL - held

    async def observe(self) -> GroupObservation:
        facts = {
            n: StageFacts(
                s.phase,
                level=1 if s.phase is WorkerPhase.ASLEEP else None,
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

    async def start(self, stage: str, *, active: bool = False) -> None:
        self.calls.append(("start-active" if active else "start", stage))
        if stage in self.broken_start:
            raise RuntimeError(f"API refused the pod of {stage}")
        s = self.stages[stage]
        if active:
            assert self._free() >= s.holds, "started Active into memory another stage holds"
            s.phase = WorkerPhase.LOADING  # the engine takes its memory while it starts
        else:
            assert not s.intent.starts_active, "a vLLM pod created asleep"
            s.phase = WorkerPhase.ASLEEP

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
        return AckFacts(task_id, True, "sleep", WorkerPhase.ASLEEP, level=level)

    async def wake(self, stage: str, task_id: str) -> AckFacts:
        self.calls.append(("wake", stage))
        s = self.stages[stage]
        assert self._free() >= s.holds, "woken into memory another stage holds"
        s.phase = WorkerPhase.ACTIVE
        return AckFacts(task_id, True, "wake", WorkerPhase.ACTIVE)

    async def fence(self, stage: str, reason: str) -> None:
        self.calls.append(("fence", stage))
        self.stages[stage].phase = WorkerPhase.ABSENT

    async def checkpoint(self, outcome: RoundOutcome) -> None:
        return None


def _vllm(want: bool = True, at: float = 2.0, request: int | None = 10 * GI) -> StageIntent:
    return StageIntent(
        "llm", want, requested_active_at=at, vram_request=request, starts_active=True
    )


def _torch(want: bool = True, at: float = 1.0) -> StageIntent:
    return StageIntent("dit", want, requested_active_at=at, vram_request=10 * GI)


# -- the arbiter ---------------------------------------------------------------------------


def test_absent_vllm_stage_is_started_only_when_admitted_and_free_covers_it() -> None:
    mem = GroupMemory(TOTAL, TOTAL, (DeviceMemory("GPU-0", TOTAL, TOTAL),))
    absent = StageFacts(WorkerPhase.ABSENT)
    d = plan({"llm": _vllm()}, {"llm": absent}, mem)
    assert d.start == ("llm",) and d.wake == ()

    low = GroupMemory(TOTAL, 6 * GI, (DeviceMemory("GPU-0", TOTAL, 6 * GI),))
    d = plan({"llm": _vllm()}, {"llm": absent}, low)
    assert d.start == ()
    assert d.waiting["llm"][0].reason is BlockReason.FREE_TOO_LOW

    d = plan({"llm": _vllm(want=False)}, {"llm": absent}, mem)
    assert d.start == () and d.admitted == ()


def test_a_vllm_stage_alone_starts_without_measured_memory_but_not_beside_others() -> None:
    """No worker has measured the device yet: alone, the engine's own start check is the gate
    (else a group of vLLM stages could never start); beside a pod, no start on a guess."""
    unknown = GroupMemory()
    absent = StageFacts(WorkerPhase.ABSENT)
    assert plan({"llm": _vllm()}, {"llm": absent}, unknown).start == ("llm",)
    intents = {"llm": _vllm(), "dit": _torch(want=False)}
    d = plan(intents, {"llm": absent, "dit": StageFacts(WorkerPhase.STARTING)}, unknown)
    assert d.start == ()
    assert d.waiting["llm"][0].reason is BlockReason.NOT_MEASURED


def test_gpu_memory_utilization_is_a_floor_of_the_footprint() -> None:
    """Without vram.request, a vLLM stage's engine takes gpuMemoryUtilization of the device:
    it is not started into less free memory than that (its worker would refuse to start)."""
    intent = StageIntent("llm", True, starts_active=True, memory_share=0.5)
    absent = StageFacts(WorkerPhase.ABSENT)
    low = GroupMemory(TOTAL, 6 * GI, (DeviceMemory("GPU-0", TOTAL, 6 * GI),))
    d = plan({"llm": intent}, {"llm": absent}, low)
    assert d.footprints["llm"] == 8 * GI and d.start == ()
    assert d.waiting["llm"][0].reason is BlockReason.FREE_TOO_LOW
    enough = GroupMemory(TOTAL, 9 * GI, (DeviceMemory("GPU-0", TOTAL, 9 * GI),))
    assert plan({"llm": intent}, {"llm": absent}, enough).start == ("llm",)


def test_holder_sleeps_before_the_vllm_stage_starts_and_its_start_blocks_other_wakes() -> None:
    mem = GroupMemory(TOTAL, 6 * GI, (DeviceMemory("GPU-0", TOTAL, 6 * GI),))
    intents = {"llm": _vllm(), "dit": _torch()}
    active = StageFacts(WorkerPhase.ACTIVE, used_bytes=10 * GI, device_uuids=("GPU-0",))
    d = plan(intents, {"llm": StageFacts(WorkerPhase.ABSENT), "dit": active}, mem)
    assert d.admitted == ("llm",) and [o.stage for o in d.sleep] == ["dit"] and d.start == ()

    # While the vLLM engine loads, no other stage is woken (its memory is not measured yet).
    small = StageIntent("tiny", True, requested_active_at=0.5, vram_request=GI)
    intents = {"llm": _vllm(), "tiny": small}
    facts = {
        "llm": StageFacts(WorkerPhase.LOADING, used_bytes=2 * GI),
        "tiny": StageFacts(WorkerPhase.ASLEEP, level=1),
    }
    full = GroupMemory(TOTAL, 14 * GI, (DeviceMemory("GPU-0", TOTAL, 14 * GI),))
    d = plan(intents, facts, full)
    assert set(d.admitted) == {"llm", "tiny"} and d.wake == ()
    assert any(b.reason is BlockReason.PODS_STARTING for b in d.waiting["tiny"])


# -- the round -----------------------------------------------------------------------------


async def test_round_hands_over_from_a_torch_stage_to_a_vllm_stage_and_back() -> None:
    sim = GroupSim(
        {
            "llm": Stage(_vllm(), WorkerPhase.ABSENT, 10 * GI),
            "dit": Stage(_torch(want=False), WorkerPhase.ACTIVE, 10 * GI),
        }
    )
    out = await run_round(sim, POLICY, lambda: "h1")
    assert sim.calls == [("sleep", "dit"), ("start-active", "llm")]
    assert out.started_active == ["llm"] and out.started == [] and not out.stage_errors

    sim.stages["llm"].phase = WorkerPhase.ACTIVE  # the engine loaded
    sim.stages["llm"].intent = _vllm(want=False)
    sim.stages["dit"].intent = _torch(at=3.0)
    sim.calls.clear()
    await run_round(sim, POLICY, lambda: "h2")
    assert sim.calls == [("sleep", "llm"), ("wake", "dit")]


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


async def test_vllm_start_error_is_reported_on_that_stage_only() -> None:
    sim = GroupSim({"llm": Stage(_vllm(), WorkerPhase.ABSENT, 10 * GI)}, broken_start={"llm"})
    out = await run_round(sim, POLICY, lambda: "h1")
    assert out.started_active == [] and "start failed" in out.stage_errors["llm"]


# -- status --------------------------------------------------------------------------------


def test_status_of_a_vllm_stage_waiting_for_admission_says_why() -> None:
    now = datetime(2026, 11, 23, tzinfo=UTC)
    d = plan(
        {"llm": _vllm()},
        {"llm": StageFacts(WorkerPhase.ABSENT)},
        GroupMemory(TOTAL, 6 * GI, (DeviceMemory("GPU-0", TOTAL, 6 * GI),)),
    )
    obs = StageObservation(
        generation=1, wants_active=True, phase=WorkerPhase.ABSENT, admitted=True,
        waiting=d.waiting["llm"], starts_when_admitted=True,
    )  # fmt: skip
    status = build_status(obs, None, now)
    assert status["state"] == Phase.WAITING.value
    ready = cond.get_condition(status["conditions"], cond.READY)
    assert ready is not None and ready["reason"] == cond.Reason.STARTS_WHEN_ADMITTED
    assert "measured free" in ready["message"]

    failed = StageObservation(
        generation=1, wants_active=True, phase=WorkerPhase.ABSENT,
        stage_problem=(cond.Reason.STAGE_ERROR.value, "start failed: boom"),
        starts_when_admitted=True,
    )  # fmt: skip
    ready = cond.get_condition(build_status(failed, None, now)["conditions"], cond.READY)
    assert ready is not None and ready["reason"] == "StageError" and "boom" in ready["message"]
