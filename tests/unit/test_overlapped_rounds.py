"""Overlapped hand-overs through ``run_round`` on the simulated GPU of ``handover_sim``: its
``SimPort`` with the three overlap calls, each with the device's physics (a sleep gives its
weights back piece by piece; a wake under a claim limit takes a piece only when the limit
allows it and the device has it, else it runs out of memory and is back asleep).

Honest, the wake runs beside the sleep and the group hands over in one round without the device
ever above its capacity; a sleeper that keeps what it says it freed starves the wake (the device
refuses it) and is fenced; a sleep not ACKed ok gives the wake no more room.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from omnistage_operator.decisions.arbiter import StageIntent, WorkerPhase
from omnistage_operator.decisions.facts import AckFacts, DeviceFigures
from omnistage_operator.decisions.handover import RoundOutcome, RoundPolicy
from omnistage_operator.decisions.handover.overlap import OverlapPort
from omnistage_operator.decisions.handover.rounds import run_round
from tests.unit.handover_sim import CONTEXT, RESERVE, UNIT, UUID, SimPort, SimWorker

PIECE = UNIT // 4
MARGIN = 64 << 20


@dataclass
class World:
    """One simulated GPU and its stages (``handover_sim.SimWorld``)."""

    capacity: int
    workers: dict[str, SimWorker]
    intents: dict[str, StageIntent]
    outcomes: list[str] = field(default_factory=list)
    created: set[str] = field(default_factory=set)
    reached: set[str] = field(default_factory=set)
    fence_pending: dict[str, bool] = field(default_factory=dict)
    learned: dict[str, int] = field(default_factory=dict)
    stuck_kubelet: set[str] = field(default_factory=set)
    measure_free: bool = True
    peak: int = 0  # the most the device held at once

    def free(self) -> int:
        return self.capacity - RESERVE - sum(w.used for w in self.workers.values() if w.alive)

    def took(self) -> None:
        self.peak = max(self.peak, self.capacity - self.free())
        assert self.free() >= 0, "the device never holds more than it has"


class OverlapSimPort(SimPort):
    """``SimPort`` with ``OverlapPort``'s calls, on the simulated device's physics."""

    world: World

    def __init__(self, world: World) -> None:
        super().__init__(world)
        self.limits: dict[str, int] = {}
        self.raises: list[int] = []
        self.raised = asyncio.Event()
        self.wake_began_before_ack = False
        self.sleep_acked = False

    async def sleep_stream(
        self, stage: str, level: int, task_id: str, *, timeout_s: float
    ) -> AsyncIterator[int | AckFacts]:
        self.calls.append(("sleep_stream", stage))
        wk = self._check(stage)
        before, free_before = wk.used, self.world.free()
        outcome = self._outcome()
        if outcome == "not_ok":
            yield self._ack(wk, task_id, False, before, free_before, error="drain timeout")
            return
        released = 0
        while released < before - CONTEXT:
            piece = min(PIECE, before - CONTEXT - released)
            released += piece
            if outcome != "lie":  # a liar says so but keeps the memory
                wk.used -= piece
            await asyncio.sleep(0)
            yield released
        wk.state, wk.level, wk.lied = WorkerPhase.ASLEEP, level, outcome == "lie"
        self.sleep_acked = True
        ack = self._ack(wk, task_id, True, before, free_before, level=level, freed_bytes=released)
        if wk.lied:  # its own figures say it holds its context; the device's free memory is real
            dev = replace(ack.devices[0], used_after=CONTEXT)
            ack = replace(ack, used_after_bytes=CONTEXT, devices=(dev,))
            wk.acks[task_id] = wk.last_ack = ack
        yield ack

    async def wake_limited(self, stage: str, task_id: str, claim_limit_bytes: int) -> AckFacts:
        self.calls.append(("wake_limited", stage))
        wk = self._check(stage)
        self.wake_began_before_ack = not self.sleep_acked
        self.limits[task_id] = max(claim_limit_bytes, self.limits.get(task_id, 0))
        before, free_before = wk.used, self.world.free()
        wk.state = WorkerPhase.WAKING
        taken = 0
        while taken < wk.weights:
            piece = min(PIECE, wk.weights - taken)
            while wk.used + piece > self.limits[task_id]:
                self.raised.clear()
                try:
                    await asyncio.wait_for(self.raised.wait(), 1.0)
                except TimeoutError:
                    return self._woke(wk, task_id, before, free_before, "claim limit left no room")
            if piece > self.world.free():  # the device refuses it: out of memory
                return self._woke(wk, task_id, before, free_before, "out of memory", short=piece)
            wk.used += piece
            taken += piece
            self.world.took()
            await asyncio.sleep(0)
        wk.state, wk.measured_fp = WorkerPhase.ACTIVE, wk.used
        return self._woke(wk, task_id, before, free_before, "")

    def _woke(
        self,
        wk: SimWorker,
        task_id: str,
        before: int,
        free_before: int,
        error: str,
        *,
        short: int = 0,
    ) -> AckFacts:
        if error:  # back asleep: what the wake took is freed
            wk.used, wk.state = CONTEXT, WorkerPhase.ASLEEP
        free = self.world.free()
        dev = DeviceFigures(UUID, 0, self.world.capacity, before, wk.used, free_before, free)
        return AckFacts(
            task_id, not error, "wake", wk.state, error=error, devices=(dev,),
            used_before_bytes=before, used_after_bytes=wk.used, free_before_bytes=free_before,
            free_after_bytes=free, total_bytes=self.world.capacity, needed_bytes=short,
        )  # fmt: skip

    async def raise_claim_limit(self, stage: str, task_id: str, claim_limit_bytes: int) -> None:
        self.raises.append(claim_limit_bytes)
        self.limits[task_id] = max(claim_limit_bytes, self.limits.get(task_id, 0))
        self.raised.set()


def _world() -> World:
    """x (8 GiB) Active, y (8 GiB) asleep and asked last, on a 12 GiB device: one at a time."""
    x = SimWorker(8 * UNIT, 0, pod=True, alive=True, state=WorkerPhase.ACTIVE, used=8 * UNIT)
    y = SimWorker(8 * UNIT, 0, pod=True, alive=True, state=WorkerPhase.ASLEEP, used=CONTEXT)
    x.used += CONTEXT
    x.measured_fp = x.measured_peak = y.measured_fp = y.measured_peak = 8 * UNIT + CONTEXT
    intents = {
        "x": StageIntent("x", True, requested_active_at=1.0),
        "y": StageIntent("y", True, requested_active_at=2.0),
    }
    world = World(12 * UNIT, {"x": x, "y": y}, intents, created={"x", "y"})
    world.took()
    return world


def _round(world: World, outcomes: list[str]) -> tuple[RoundOutcome, OverlapSimPort]:
    world.outcomes = list(outcomes)
    port = OverlapSimPort(world)
    assert isinstance(port, OverlapPort)
    policy = RoundPolicy(
        ack_retries=1, backoff_s=0.0, margin_bytes=MARGIN, transition_allowance_s=5.0,
        overlapped=True,
    )  # fmt: skip
    ids = itertools.count(1)
    return asyncio.run(run_round(port, policy, lambda: f"h{next(ids)}")), port


def test_the_wake_runs_beside_the_sleep_within_the_device() -> None:
    world = _world()
    out, port = _round(world, ["ok"])
    assert port.wake_began_before_ack
    assert ("wake", "y") not in port.calls  # no second, serial wake
    assert out.wakes["y"].ok and [s.ok for s in out.sleeps] == [True]
    assert world.workers["y"].state is WorkerPhase.ACTIVE
    assert world.workers["x"].used == CONTEXT
    assert world.peak <= world.capacity


def test_a_sleeper_that_keeps_its_memory_starves_the_wake_and_is_fenced() -> None:
    world = _world()
    out, port = _round(world, ["lie"])
    # the device refused the wake beside it what the liar kept
    assert out.wake_errors["y"] == "out of memory"
    [sleep] = out.sleeps
    assert sleep.contradiction and "to the end of the wake beside it" in sleep.contradiction
    assert sleep.fenced
    # then y woke the serial way, after the liar's fence
    assert port.calls.index(("fence", "x")) < port.calls.index(("wake", "y"))
    assert out.wakes["y"].ok and world.workers["y"].state is WorkerPhase.ACTIVE
    assert world.peak <= world.capacity


def test_a_sleep_not_acked_ok_gives_the_wake_no_more_room() -> None:
    world = _world()
    out, port = _round(world, ["not_ok"])
    # the sleep went on the ordinary way, under the plain task id, and ACKed ok
    assert ("sleep", "x") in port.calls
    [sleep] = out.sleeps
    assert sleep.ok and sleep.task_id == "h1-x-sleep1"
    assert world.workers["x"].used == CONTEXT
    # the wake beside it got no room past its first limit (what it held and the room beside
    # x): never raised, it is left to end on its own, read by the next round (no second wake)
    assert port.raises == []
    assert world.workers["y"].state is not WorkerPhase.ACTIVE and ("wake", "y") not in port.calls
    assert world.peak <= world.capacity
