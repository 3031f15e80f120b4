"""A group's loop tells when the round that took a kick has ended (``GroupLoops.settled``).

The leader's spec handler waits for it: kopf holds the stage's later watch events (the round's
own status writes) meanwhile and handles only the last, not each one beside the hand-over.
"""

from __future__ import annotations

import asyncio

from omnistage_operator.k8s import metrics
from omnistage_operator.runtime.group_loops import BUSY_ROUNDS, BUSY_STRETCH, GroupLoops, _Loop


class Loops(GroupLoops):
    """Rounds that wait for the test's word; each records the kicks it saw."""

    def __init__(self) -> None:
        self._loops: dict[tuple[str, str], _Loop] = {}
        self._retry_in: dict[tuple[str, str], float] = {}
        self._in_round = 0
        self.gate = asyncio.Event()
        self.rounds = 0

    async def round(self, namespace: str, group: str) -> bool:
        self.rounds += 1
        await self.gate.wait()
        return False


async def test_settled_waits_for_the_round_that_takes_the_kick() -> None:
    loops = Loops()
    loops.kick("ns", "g")
    await asyncio.sleep(0)  # the first round begins and waits
    assert loops.rounds == 1
    loops.kick("ns", "g")  # during that round: a second one takes it
    waiter = asyncio.create_task(loops.settled("ns", "g", 5.0))
    loops.gate.set()
    assert await waiter is True
    assert loops.rounds == 2  # not the round that was running when it was kicked


async def test_settled_gives_up_after_its_bound() -> None:
    loops = Loops()
    loops.kick("ns", "g")
    assert await loops.settled("ns", "g", 0.05) is False
    loops.gate.set()
    assert await loops.settled("ns", "g", 1.0) is False  # no kick pending: nothing to wait for


async def test_a_failed_round_ends_the_wait() -> None:
    class Failing(Loops):
        async def round(self, namespace: str, group: str) -> bool:
            raise RuntimeError("boom")

    loops = Failing()
    loops.kick("ns", "g")
    assert await loops.settled("ns", "g", 5.0) is True
    for loop in loops._loops.values():  # the retry after the failure
        if loop.followup is not None:
            loop.followup.cancel()


async def test_a_round_that_outlasts_the_resync_interval_takes_no_resync_after_it() -> None:
    """A storm's hand-over round may wait longer than the interval for API slots: the resync
    steps during it do not queue a second round (it read the group itself)."""
    loops = Loops()
    loops.kick("ns", "g")
    await asyncio.sleep(0)  # the round begins and waits; the last one ended long ago
    assert loops.rounds == 1
    for _ in range(3):  # resync steps while it runs
        loops.resync("ns", "g", 0.01)
    loop = loops._loops[("ns", "g")]
    loops.gate.set()
    await asyncio.wait_for(loop.task or asyncio.sleep(0), 5.0)  # the loop ends
    assert loops.rounds == 1
    loops.resync("ns", "g", 0.0)  # after it, the interval counts from its end
    await asyncio.wait_for(loop.task or asyncio.sleep(0), 5.0)
    assert loops.rounds == 2


async def test_while_a_storm_runs_a_settled_group_is_resynced_less_often() -> None:
    """A storm's rounds (``BUSY_ROUNDS`` or more at once) are not joined by a settled group's
    resync round every interval: at 2000 stages those were most of a storm's rounds."""
    loops = Loops()
    loops.gate.set()
    loops.kick("ns", "idle")
    idle = loops._loops[("ns", "idle")]
    await asyncio.wait_for(idle.task or asyncio.sleep(0), 5.0)
    assert loops.rounds == 1
    idle.last_round -= 2.0  # its last round ended two intervals ago (interval 1 s)
    loops.gate.clear()
    for i in range(BUSY_ROUNDS):  # the storm: its rounds wait for the test
        loops.kick("ns", f"g{i}")
    await asyncio.sleep(0)
    assert loops._in_round == BUSY_ROUNDS
    loops.resync("ns", "idle", 1.0)
    assert not idle.dirty.is_set()  # within the stretched interval: no resync round
    idle.last_round -= BUSY_STRETCH  # past it: resynced even so
    loops.resync("ns", "idle", 1.0)
    assert idle.dirty.is_set()
    loops.gate.set()
    for loop in list(loops._loops.values()):
        await asyncio.wait_for(loop.task or asyncio.sleep(0), 5.0)
    assert loops._in_round == 0
    idle.last_round -= 2.0  # the storm is over: the interval is the interval again
    loops.resync("ns", "idle", 1.0)
    assert idle.dirty.is_set()
    await asyncio.wait_for(idle.task or asyncio.sleep(0), 5.0)


async def test_rounds_are_counted_by_what_asked_for_them_first() -> None:
    second = asyncio.Event()

    class BusyOnce(Loops):
        async def round(self, namespace: str, group: str) -> bool:
            self.rounds += 1
            if self.rounds == 2:
                second.set()
            return self.rounds == 1  # the first round leaves something in progress

    def count(cause: str) -> float:
        return float(metrics.ROUND_KICKS.labels(cause)._value.get())

    before = {cause: count(cause) for cause in ("event", "busy", "resync")}
    loops = BusyOnce()
    loops.kick("ns", "g")
    loops.kick("ns", "g")  # joins the round already asked: not counted again
    await asyncio.wait_for(second.wait(), 5.0)  # the busy round's follow-up
    loops.resync("ns", "g", 0.0)  # settled, interval over: a resync round
    assert {cause: count(cause) - n for cause, n in before.items()} == {
        "event": 1,
        "busy": 1,
        "resync": 1,
    }
