"""When a worker's demand report kicks its group's round (``runtime.demand_watch``): only with
something the group's last round did not see; a report that comes during a round is judged
when the round ends."""

from __future__ import annotations

import asyncio

from omnistage_operator.decisions.arbiter import WorkerPhase
from omnistage_operator.decisions.ondemand import Demand
from omnistage_operator.runtime.demand_watch import DemandReport, DemandWatcher, _seen, _Stream

KEY = ("ns", "b")


def _report(
    *, held: int = 0, active: bool = False, inflight: int = 0, transition: bool = False
) -> DemandReport:
    return DemandReport(Demand(held=held, inflight=inflight), active=active, transition=transition)


async def _watcher() -> tuple[DemandWatcher, list[tuple[str, str]], _Stream]:
    kicks: list[tuple[str, str]] = []
    watcher = DemandWatcher(lambda ns, group: kicks.append((ns, group)), lambda ns: 1)
    task = asyncio.create_task(asyncio.sleep(3600))
    stream = _Stream("uid", "g", task)
    watcher._streams[KEY] = stream  # the stream of b, as ``shape`` opens it
    return watcher, kicks, stream


async def test_the_reports_of_a_rounds_own_sleep_and_wake_kick_nothing() -> None:
    watcher, kicks, stream = await _watcher()
    stream.report = _report(active=True)
    stream.seen = _seen(stream.report, WorkerPhase.ACTIVE)  # the round's first shape
    watcher.round_began("ns", "g")
    watcher._on_report(KEY, "g", _report(active=False))  # the sleep it ordered
    stream.seen = _seen(stream.report, WorkerPhase.ASLEEP)  # its last shape, after the ACK
    watcher.round_ended("ns", "g")
    assert kicks == []
    watcher._on_report(KEY, "g", _report(active=False))  # a late copy of the same
    assert kicks == []
    await watcher.close()


async def test_a_report_the_round_did_not_see_kicks_at_its_end() -> None:
    watcher, kicks, stream = await _watcher()
    stream.report = _report()
    stream.seen = _seen(stream.report, WorkerPhase.ASLEEP)
    watcher.round_began("ns", "g")
    watcher._on_report(KEY, "g", _report(held=1))  # after the round's last shape
    assert kicks == []  # not in the middle of the round
    watcher.round_ended("ns", "g")
    assert kicks == [("ns", "g")]
    await watcher.close()


async def test_a_report_only_the_rounds_last_plan_saw_kicks_when_that_plan_orders() -> None:
    watcher, kicks, stream = await _watcher()
    stream.report = _report()
    stream.seen = _seen(stream.report, WorkerPhase.ASLEEP)
    watcher.round_began("ns", "g")
    watcher._on_report(KEY, "g", _report(held=1))
    stream.seen = _seen(stream.report, WorkerPhase.ASLEEP)  # the last shape, after the wakes
    watcher.round_ordered("ns", "g")  # its plan wakes b: nobody acted on it
    watcher.round_ended("ns", "g")
    assert kicks == [("ns", "g")]
    await watcher.close()


async def test_outside_a_round_news_kicks_at_once_and_a_repeat_does_not() -> None:
    watcher, kicks, stream = await _watcher()
    watcher._on_report(KEY, "g", _report(active=True))  # the first report: nothing seen yet
    assert kicks == [("ns", "g")]
    stream.seen = _seen(stream.report, WorkerPhase.ACTIVE)
    watcher._on_report(KEY, "g", _report(active=True))
    watcher._on_report(KEY, "g", _report(active=True, inflight=2))
    assert kicks == [("ns", "g")] * 2  # requests in flight: news
    await watcher.close()


async def test_a_late_report_of_a_transition_the_round_saw_end_kicks_nothing() -> None:
    watcher, kicks, stream = await _watcher()
    stream.report = _report()
    stream.seen = _seen(stream.report, WorkerPhase.ACTIVE)  # the round's wake ACK
    watcher._on_report(KEY, "g", _report(transition=True))  # Waking, delivered after the ACK
    assert kicks == []
    watcher._on_report(KEY, "g", _report(active=False))  # Asleep (or Failed): news
    assert kicks == [("ns", "g")]
    await watcher.close()
