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
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from omnistage_operator.decisions.arbiter import StageIntent, WorkerPhase
from omnistage_operator.decisions.facts import AckFacts, RoomBeside
from omnistage_operator.decisions.handover import GroupObservation, RoundOutcome, RoundPolicy
from omnistage_operator.decisions.handover.overlap import OverlapPort, handoff_channel
from omnistage_operator.decisions.handover.rounds import run_round
from tests.unit.handover_sim import CONTEXT, RESERVE, UNIT, SimWorker
from tests.unit.overlap_sim import OverlapSimPort

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

    def free(self) -> int:
        return self.capacity - RESERVE - sum(w.used for w in self.workers.values() if w.alive)


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
    return World(12 * UNIT, {"x": x, "y": y}, intents, created={"x", "y"})


class KeptFirst(OverlapSimPort):
    """Its first observation is the kept readings of the round before (as the operator's port
    gives when nothing changed since); it notes how many it gave before the sleep began."""

    def __init__(self, world: World) -> None:
        super().__init__(world)
        self.observed = 0
        self.observed_before_sleep = 0

    async def observe(self) -> GroupObservation:
        self.observed += 1
        obs = await super().observe()
        return replace(obs, kept=True) if self.observed == 1 else obs

    def sleep_stream(
        self, stage: str, level: int, task_id: str, *, timeout_s: float, handoff_channel: str = ""
    ) -> AsyncIterator[int | RoomBeside | AckFacts]:
        self.observed_before_sleep = self.observed_before_sleep or self.observed
        return super().sleep_stream(
            stage, level, task_id, timeout_s=timeout_s, handoff_channel=handoff_channel
        )


def _round(
    world: World,
    outcomes: list[str],
    port_type: type[OverlapSimPort] = OverlapSimPort,
    *,
    handoff: bool = False,
) -> tuple[RoundOutcome, OverlapSimPort]:
    world.outcomes = list(outcomes)
    port = port_type(world)
    port.handoff = handoff
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
    assert port.calls.count(("wake", "y")) == 1  # no second, serial wake
    assert out.wakes["y"].ok and [s.ok for s in out.sleeps] == [True]
    assert world.workers["y"].state is WorkerPhase.ACTIVE
    assert world.workers["x"].used == CONTEXT
    assert port.peak <= world.capacity
    assert sorted(port.channels) == [("sleep", ""), ("wake", "")]  # no hand-off directory


def test_workers_that_hand_over_get_one_channel_named_after_the_wake() -> None:
    world = _world()
    out, port = _round(world, ["ok"], handoff=True)
    assert out.wakes["y"].ok and [s.ok for s in out.sleeps] == [True]
    (sleep, channel), (wake, same) = sorted(port.channels)
    assert (sleep, wake) == ("sleep", "wake") and channel == same
    assert channel == handoff_channel(out.wakes["y"].task_id)
    assert re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", channel)  # a name a worker takes
    assert port.peak <= world.capacity


def test_a_sleeper_that_keeps_its_memory_starves_the_wake_and_is_fenced() -> None:
    world = _world()
    out, port = _round(world, ["lie"])
    # the device refused the wake beside it what the liar kept
    assert out.wake_errors["y"] == "out of memory"
    [sleep] = out.sleeps
    assert sleep.contradiction and "the wake beside it" in sleep.contradiction
    assert sleep.fenced
    # then y woke the serial way, after the liar's fence
    assert port.calls.count(("wake", "y")) == 2
    assert port.calls.index(("fence", "x")) < len(port.calls) - 1 - port.calls[::-1].index(
        ("wake", "y")
    )
    assert out.wakes["y"].ok and world.workers["y"].state is WorkerPhase.ACTIVE
    assert port.peak <= world.capacity


def test_a_sleep_not_acked_ok_gives_the_wake_no_more_room() -> None:
    world = _world()
    out, port = _round(world, ["not_ok"])
    # the sleep went on the ordinary way, under the plain task id, and ACKed ok
    assert port.calls.count(("sleep", "x")) == 2
    [sleep] = out.sleeps
    assert sleep.ok and sleep.task_id == "h1-x-sleep1"
    assert world.workers["x"].used == CONTEXT
    # the wake beside it got no room past its first limit (what it held and the room beside
    # x): never raised, it is left to end on its own, read by the next round (no second wake)
    assert port.raises == []
    assert world.workers["y"].state is not WorkerPhase.ACTIVE
    assert port.calls.count(("wake", "y")) == 1
    assert port.peak <= world.capacity


def test_kept_readings_pair_the_wake_with_the_room_the_sleeper_measured() -> None:
    """A lone sleep planned from kept readings carries its wake without reading the workers
    again: the wake starts under what it holds, raised first by the room beside the sleeper
    that the sleeping worker measured before it released anything."""
    world = _world()
    room = world.free()
    out, port = _round(world, ["ok"], KeptFirst)
    assert isinstance(port, KeptFirst)
    assert out.from_kept and port.observed_before_sleep == 1
    assert port.wake_began_before_ack and out.wakes["y"].ok
    assert port.raises[0] == CONTEXT + room - MARGIN  # before any release
    assert port.raises[1:] and min(port.raises[1:]) > port.raises[0]
    assert world.workers["y"].state is WorkerPhase.ACTIVE and port.peak <= world.capacity


def test_a_sleep_draining_a_request_the_readings_missed_is_joined_not_sent_again() -> None:
    """The round paired x from readings without requests in flight; one came before the sleep.
    The worker drains it, gives no room beside it meanwhile, and the stream's deadline cuts the
    call: the same task is joined (its Ack carries the drain), not a new sleep sent under
    another id (which would have answered a no-op, the drain lost), and nothing is fenced."""
    world = _world()
    out, port = _round(world, ["drain"])
    [sleep] = out.sleeps
    assert sleep.ok and not sleep.fenced and not sleep.contradiction
    assert sleep.task_id == "h1-x-sleep1-overlapped" and sleep.ack is not None
    assert sleep.ack.drain_s > 0 and sleep.ack.freed_bytes == 8 * UNIT
    assert port.calls.count(("sleep", "x")) == 2  # the stream, then the join of its task
    assert world.workers["x"].used == CONTEXT
    assert port.peak <= world.capacity
