"""A long drain runs in the background: the group's other transitions go on, the gate holds.

Before ``sleep_tasks``, a round gathered every sleep it sent before doing anything else, so a
stage draining a long request held up every other stage of its group for its drain timeout.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from omnistage_operator.decisions.arbiter import (
    BlockReason,
    DeviceMemory,
    GroupMemory,
    StageFacts,
    StageIntent,
    WorkerPhase,
)
from omnistage_operator.decisions.facts import AckFacts, DeviceFigures
from omnistage_operator.decisions.handover import GroupObservation, RoundOutcome, RoundPolicy
from omnistage_operator.decisions.handover.rounds import run_round
from omnistage_operator.decisions.handover.sleep_tasks import SleepTracker

GI = 1 << 30
TOTAL = 16 * GI
POLICY = RoundPolicy(ack_retries=1, backoff_s=0.01, transition_allowance_s=5.0, round_wait_s=2.0)


@dataclass
class DrainPort:
    """``a`` (4 GiB) serves a request until ``release`` is set, ``c`` (2 GiB) sleeps at once,
    ``b`` (asleep) wants 12 GiB: both must sleep first. ``lie``: a's ACK says ok, frees nothing."""

    release: asyncio.Event = field(default_factory=asyncio.Event)
    phase: dict[str, WorkerPhase] = field(
        default_factory=lambda: {
            "a": WorkerPhase.ACTIVE,
            "b": WorkerPhase.ASLEEP,
            "c": WorkerPhase.ACTIVE,
        }
    )
    holds: dict[str, int] = field(default_factory=lambda: {"a": 4 * GI, "b": 0, "c": 2 * GI})
    a_inflight: int = 1
    lie: bool = False
    wants: dict[str, bool] = field(default_factory=lambda: {"a": False, "b": True, "c": False})
    fenced: set[str] = field(default_factory=set)
    calls: list[tuple[str, str]] = field(default_factory=list)

    def _free(self) -> int:
        return TOTAL - GI - sum(self.holds.values())

    async def observe(self) -> GroupObservation:
        intents = {
            "a": StageIntent("a", self.wants["a"], drain_timeout_s=600.0, vram_request=4 * GI),
            "b": StageIntent("b", self.wants["b"], vram_request=12 * GI),
            "c": StageIntent("c", self.wants["c"]),
        }
        facts = {n: self._fact(n) for n in self.phase}
        free = self._free()
        return GroupObservation(
            intents, facts, GroupMemory(TOTAL, free, (DeviceMemory("GPU-0", TOTAL, free),))
        )

    def _fact(self, n: str) -> StageFacts:
        if n in self.fenced:
            return StageFacts(WorkerPhase.ABSENT)
        p = self.phase[n]
        return StageFacts(
            p, level=1 if p is WorkerPhase.ASLEEP else None, used_bytes=self.holds[n],
            inflight_requests=self.a_inflight if n == "a" else 0, device_uuids=("GPU-0",),
        )  # fmt: skip

    async def probe(self, stage: str) -> StageFacts:
        return (await self.observe()).facts[stage]

    async def start(self, stage: str) -> None:
        raise AssertionError("no pod is created here")

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
        if stage == "a":
            self.phase["a"] = WorkerPhase.SLEEPING  # draining its request
            await self.release.wait()
            self.a_inflight = 0
        self.phase[stage] = WorkerPhase.ASLEEP
        freed, free_before = self.holds[stage], self._free()
        if not (self.lie and stage == "a"):  # a liar says all of it left; the device disagrees
            self.holds[stage] = 0
        dev = DeviceFigures("GPU-0", 0, TOTAL, freed, 0, free_before, self._free())
        return AckFacts(
            task_id, True, "sleep", WorkerPhase.ASLEEP, level=level, freed_bytes=freed,
            devices=(dev,), free_before_bytes=free_before, free_after_bytes=self._free(),
            total_bytes=TOTAL,
        )  # fmt: skip

    async def wake(self, stage: str, task_id: str) -> AckFacts:
        self.calls.append(("wake", stage))
        if stage == "a":
            assert self.release.is_set(), "a woken before its own sleep's ACK was taken"
            self.phase[stage], self.holds[stage] = WorkerPhase.ACTIVE, 4 * GI
            return AckFacts(task_id, True, "wake", WorkerPhase.ACTIVE)
        assert self.holds["a"] == 0 or "a" in self.fenced, "wake while a may hold memory"
        assert self.holds["c"] == 0, "wake while c may hold memory"
        self.phase[stage] = WorkerPhase.ACTIVE
        self.holds[stage] = 12 * GI
        return AckFacts(task_id, True, "wake", WorkerPhase.ACTIVE)

    async def fence(self, stage: str, reason: str) -> None:
        self.calls.append(("fence", stage))
        self.fenced.add(stage)
        self.holds[stage] = 0

    async def checkpoint(self, outcome: RoundOutcome) -> None:
        self.calls.append(("checkpoint", ",".join(s.order.stage for s in outcome.sleeps)))


async def test_a_draining_sleep_holds_up_nothing_but_the_wake_it_gates() -> None:
    port = DrainPort()
    kicks = asyncio.Event()
    tracker = SleepTracker(kicks.set)
    ids = iter(f"h{i}" for i in range(1, 9))

    # Round 1 ends while a drains (it used to wait for the drain): c's ACK is in and published.
    out = await asyncio.wait_for(run_round(port, POLICY, lambda: next(ids), tracker), 3.0)
    assert [s.order.stage for s in out.sleeps] == ["c"] and out.sleeps[0].ok
    assert out.sleeps_running == frozenset({"a"}) and not out.wakes
    assert ("checkpoint", "c") in port.calls
    assert out.decision is not None
    reasons = {b.reason for b in out.decision.waiting["b"] if b.stage == "a"}
    assert BlockReason.AWAITING_ACK in reasons  # a's sleep is out: no wake on a guess

    # Round 2, a still draining: no second order to a, no wake of b on a guess.
    out = await asyncio.wait_for(run_round(port, POLICY, lambda: next(ids), tracker), 3.0)
    assert not out.sleeps and not out.wakes and out.handover_id == "h1"
    assert port.calls.count(("sleep", "a")) == 1
    assert out.decision is not None
    assert any(b.reason is BlockReason.AWAITING_ACK for b in out.decision.waiting["b"])
    assert not kicks.is_set()

    # The drain ends: the group is kicked, the next round takes a's ACK, publishes it, wakes b.
    port.release.set()
    await asyncio.wait_for(kicks.wait(), 3.0)
    out = await run_round(port, POLICY, lambda: next(ids), tracker)
    assert [s.order.stage for s in out.sleeps] == ["a"] and out.sleeps[0].ok
    assert list(out.wakes) == ["b"] and out.handover_id == "h1"
    assert port.calls.index(("checkpoint", "a")) < port.calls.index(("wake", "b"))
    assert tracker.handover() is None and not tracker.running


async def test_a_contradicted_ack_from_a_background_sleep_is_fenced_before_any_wake() -> None:
    port = DrainPort(lie=True)
    kicks = asyncio.Event()
    tracker = SleepTracker(kicks.set)
    ids = iter(f"h{i}" for i in range(1, 9))
    out = await asyncio.wait_for(run_round(port, POLICY, lambda: next(ids), tracker), 3.0)
    assert out.sleeps_running == frozenset({"a"})
    port.release.set()
    await asyncio.wait_for(kicks.wait(), 3.0)  # the task judged the ACK and fenced a
    out = await run_round(port, POLICY, lambda: next(ids), tracker)
    (a,) = [s for s in out.sleeps if s.order.stage == "a"]
    assert not a.ok and a.fenced and a.contradiction
    assert port.calls.index(("fence", "a")) < port.calls.index(("wake", "b"))


async def test_without_a_tracker_a_round_waits_for_its_drains() -> None:
    port = DrainPort()
    round_ = asyncio.ensure_future(run_round(port, POLICY, lambda: "h1"))
    await asyncio.sleep(0.3)
    assert not round_.done()  # the simulator's round: one round per hand-over
    port.release.set()
    out = await asyncio.wait_for(round_, 3.0)
    assert {s.order.stage for s in out.sleeps} == {"a", "c"} and list(out.wakes) == ["b"]


async def test_a_stage_ordered_again_in_an_open_hand_over_gets_a_new_task_id() -> None:
    """A worker replays its cached Ack for a task id it has seen: a second sleep order of one
    stage in a hand-over that spans rounds must not reuse the first one's id."""
    tracker = SleepTracker(lambda: None)
    tracker.open("h1")
    assert tracker.task_id("c", "h1-c-sleep1") == "h1-c-sleep1"
    assert tracker.task_id("c", "h1-c-sleep1") == "h1-c-sleep1-o2"
    assert tracker.task_id("a", "h1-a-sleep1") == "h1-a-sleep1"


async def test_a_stage_is_not_woken_while_its_own_sleep_is_out() -> None:
    port = DrainPort()
    kicks = asyncio.Event()
    tracker = SleepTracker(kicks.set)
    ids = iter(f"h{i}" for i in range(1, 9))
    await asyncio.wait_for(run_round(port, POLICY, lambda: next(ids), tracker), 3.0)
    # a's worker is asleep but its ACK is not in yet; a is asked Active again, b no longer
    port.wants.update(a=True, b=False)
    port.phase["a"], port.holds["a"], port.a_inflight = WorkerPhase.ASLEEP, 0, 0
    out = await asyncio.wait_for(run_round(port, POLICY, lambda: next(ids), tracker), 3.0)
    assert "a" in out.decision.admitted if out.decision else False
    assert ("wake", "a") not in port.calls and not out.wakes
    port.release.set()
    await asyncio.wait_for(kicks.wait(), 3.0)
    out = await run_round(port, POLICY, lambda: next(ids), tracker)
    assert [s.order.stage for s in out.sleeps] == ["a"] and list(out.wakes) == ["a"]
