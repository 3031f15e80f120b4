"""Events wait for a moment no round runs (``event_lane.EventLane``), in order per stage.

In a storm the operator's CPU is what the hand-overs wait for; an Event is posted once no round
runs (or once it waited ``max_hold_s``), none dropped, one stage's in the order they were put.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Callable
from typing import Any

from omnistage_operator.k8s.kube import _TALLY, tallied
from omnistage_operator.k8s.settings import Settings
from omnistage_operator.runtime.event_lane import EventLane
from omnistage_operator.runtime.runner import GroupRunner

MARK: contextvars.ContextVar[str] = contextvars.ContextVar("mark", default="")


async def _until(what: Callable[[], bool], within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while not what():
        assert time.monotonic() < deadline, "not within the deadline"
        await asyncio.sleep(0.005)


async def _turns(n: int = 50) -> None:
    """Let every ready task run ``n`` times over (nothing here waits on time)."""
    for _ in range(n):
        await asyncio.sleep(0)


class Events:
    """A kube whose Events are noted (stage, reason) when their post ends."""

    def __init__(self) -> None:
        self.posted: list[tuple[str, str]] = []

    async def event(self, involved: Any, *, reason: str, message: str, warning: bool) -> None:
        self.posted.append((involved["metadata"]["name"], reason))


class GatedRunner(GroupRunner):
    """A runner whose rounds last until ``gate`` is set."""

    gate: asyncio.Event

    async def round(self, namespace: str, group: str) -> bool:
        await self.gate.wait()
        return False


def _body(name: str) -> dict[str, Any]:
    return {"apiVersion": "omnistage.io/v1alpha1", "kind": "OmniStage",
            "metadata": {"name": name, "namespace": "ns", "uid": f"u-{name}"}}  # fmt: skip


async def test_an_event_waits_while_a_round_runs_and_goes_when_none_does() -> None:
    kube = Events()
    runner = GatedRunner(kube, Settings())  # type: ignore[arg-type]
    runner.gate = asyncio.Event()
    runner.kick("ns", "g")
    await _until(lambda: runner._in_round == 1)
    runner.emit(_body("a"), "Woken", "ACK h1")
    await _turns()
    assert kube.posted == []  # a round runs: held
    runner.gate.set()
    await _until(lambda: kube.posted == [("a", "Woken")])
    assert runner._in_round == 0
    await runner.close()


async def test_an_event_goes_at_once_when_no_round_runs() -> None:
    kube = Events()
    runner = GatedRunner(kube, Settings())  # type: ignore[arg-type]
    runner.emit(_body("a"), "PodCreated", "worker pod created asleep")
    await _until(lambda: kube.posted == [("a", "PodCreated")])
    await runner.close()


async def test_one_key_in_order_one_at_a_time_others_beside_it() -> None:
    lane = EventLane(lambda: True, concurrency=4)
    log: list[str] = []
    first_may_end = asyncio.Event()

    def post(name: str, wait: asyncio.Event | None = None) -> Callable[[], Any]:
        async def run() -> None:
            log.append(f"begin {name}")
            if wait is not None:
                await wait.wait()
            log.append(f"end {name}")

        return run

    lane.put("a", post("a1", first_may_end))
    lane.put("a", post("a2"))
    lane.put("b", post("b1"))
    await _until(lambda: "end b1" in log)
    assert "begin a2" not in log  # a1 still in flight: a2 waits behind it
    first_may_end.set()
    await _until(lambda: "end a2" in log)
    assert log.index("end a1") < log.index("begin a2")
    assert len(lane) == 0


async def test_nothing_is_dropped_and_each_key_keeps_its_order() -> None:
    lane = EventLane(lambda: True, concurrency=4)
    seen: list[tuple[int, int]] = []

    def post(key: int, n: int) -> Callable[[], Any]:
        async def run() -> None:
            await asyncio.sleep(0)
            seen.append((key, n))

        return run

    for n in range(20):
        for key in range(10):
            lane.put(key, post(key, n))
    await _until(lambda: len(seen) == 200)
    for key in range(10):
        assert [n for k, n in seen if k == key] == list(range(20))


async def test_a_held_event_goes_after_max_hold_however_busy() -> None:
    lane = EventLane(lambda: False, max_hold_s=0.05)
    done: list[str] = []

    async def run() -> None:
        done.append("x")

    t0 = time.monotonic()
    lane.put("a", run)
    await _until(lambda: done == ["x"])
    assert time.monotonic() - t0 >= 0.05


async def test_a_failed_post_does_not_stop_the_next_and_each_runs_in_its_context() -> None:
    lane = EventLane(lambda: True)
    marks: list[str] = []

    async def fails() -> None:
        raise RuntimeError("API down")

    async def notes() -> None:
        marks.append(MARK.get())

    token = MARK.set("round-7")  # the putter's context: not kept, unless given
    lane.put("a", fails)
    lane.put("a", notes)
    lane.put("a", notes, contextvars.copy_context())
    MARK.reset(token)
    await _until(lambda: marks == ["", "round-7"])


async def test_a_held_event_is_counted_in_its_rounds_tally_and_keeps_nothing_else() -> None:
    kube = Events()
    runner = GroupRunner(kube, Settings())  # type: ignore[arg-type]
    counted: list[int] = []

    async def event(involved: Any, *, reason: str, message: str, warning: bool) -> None:
        tally = _TALLY.get()
        counted.append(tally.requests if tally is not None else -1)
        assert MARK.get() == ""  # the round's other context variables stay behind

    kube.event = event  # type: ignore[method-assign]
    runner._in_round = 1  # a round runs: the Event is held
    token = MARK.set("round-7")
    with tallied() as tally:
        tally.requests = 5
        runner.emit(_body("a"), "Woken", "ACK h1")
    MARK.reset(token)
    runner._in_round = 0
    runner.rounds_idle()
    await _until(lambda: counted == [5])


async def test_closing_posts_what_is_held_while_a_round_still_runs() -> None:
    """The operator ending (a rolling update, a lost Lease) posts the held Events first, in
    order per stage, instead of dropping them; a post that hangs past ``flush_s`` is the only
    one lost."""
    lane = EventLane(lambda: False, concurrency=2)  # a round runs the whole time
    posted: list[str] = []
    hang = asyncio.Event()

    def post(name: str, wait: asyncio.Event | None = None) -> Callable[[], Any]:
        async def run() -> None:
            if wait is not None:
                await wait.wait()
            posted.append(name)

        return run

    for name in ("a1", "a2", "b1"):
        lane.put(name[0], post(name))
    await _turns()
    assert posted == []  # held: a round runs
    await lane.close(flush_s=5.0)
    assert sorted(posted) == ["a1", "a2", "b1"] and posted.index("a1") < posted.index("a2")

    stuck = EventLane(lambda: False)
    stuck.put("c", post("c1", hang))
    began = time.monotonic()
    await stuck.close(flush_s=0.2)
    assert time.monotonic() - began < 5 and "c1" not in posted and len(stuck) == 0
