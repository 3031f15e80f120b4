"""Sleeps that outlive a round: one group's hand-over whose sleeps run as tracked tasks.

A sleep waits for its worker's drain of in-flight requests (up to the stage's drain timeout,
minutes) before its ACK. A round that waited for every sleep it sent would hold up every other
transition of the group for that long: another stage's sleep, a fence, a status publish, a
patched state. So the runner keeps one ``SleepTracker`` per group across rounds:

- a round launches each sleep order as a task (``launch``) and waits only for the sleeps that
  had no request in flight when ordered, and for those at most ``wait_s`` (``settle``); a
  draining sleep goes on in the background, and its end kicks the group (``on_done``);
- the hand-over stays open while any of its sleeps runs: every round plans with its bookkeeping
  (``handover``), so a stage whose sleep is still out is an outstanding sleeper and no wake of
  the group goes out on a guess;
- results are taken by the next round (``collect``): its ok ACKs (verified against the device by
  the task itself) and confirmed fences count toward the hand-over, and once no sleep runs the
  hand-over closes (``close_if_idle``) after the round that planned with its last results;
- a stage with a sleep in flight gets no second order (``running``).

A task that ended with ``LeadershipLost`` (this operator no longer leads) ends the round that
collects it: nothing more is ordered, and the next round (or leader) reads the worker's state.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from omnistage_operator.decisions.arbiter import FenceOrder, Handover, SleepOrder
from omnistage_operator.decisions.leadership import LeadershipLost

if TYPE_CHECKING:
    from omnistage_operator.decisions.handover import FenceResult, SleepResult

__all__ = ["SleepTracker"]

log = logging.getLogger(__name__)


@dataclass
class _Open:
    """The hand-over in progress: who had to sleep or be fenced, who ACKed ok, who was fenced."""

    id: str
    began: float
    sleepers: set[str] = field(default_factory=set)
    acked: set[str] = field(default_factory=set)
    fenced: set[str] = field(default_factory=set)
    orders: dict[str, int] = field(default_factory=dict)  # sleep orders sent, per stage


class SleepTracker:
    """One group's sleeps in flight and the hand-over they belong to."""

    def __init__(self, on_done: Callable[[], None] | None = None, *, background: bool = True):
        """``on_done``: called when a sleep ends that no round is waiting for (the runner kicks
        the group). ``background``: False waits for every sleep in the round that sent it (the
        behaviour of a round run alone, as in the simulator)."""
        self._on_done = on_done
        self.background = background
        self._tasks: dict[str, tuple[SleepOrder, asyncio.Task[SleepResult]]] = {}
        self._open: _Open | None = None
        self._waiting = False

    # -- state -----------------------------------------------------------------------------

    @property
    def running(self) -> frozenset[str]:
        """Stages whose sleep task has not been collected yet."""
        return frozenset(self._tasks)

    @property
    def handover_id(self) -> str | None:
        """The open hand-over's id (None: none open)."""
        return self._open.id if self._open is not None else None

    @property
    def began(self) -> float | None:
        """When the open hand-over sent its first order (monotonic)."""
        return self._open.began if self._open is not None else None

    def handover(self) -> Handover | None:
        """The open hand-over's bookkeeping for the arbiter (a running sleep is outstanding)."""
        o = self._open
        if o is None:
            return None
        return Handover(o.id, frozenset(o.sleepers), frozenset(o.acked), frozenset(o.fenced))

    # -- acting ----------------------------------------------------------------------------

    def open(self, hid: str) -> str:
        """Continue the open hand-over, or open one under ``hid``; its id."""
        if self._open is None:
            self._open = _Open(hid, time.monotonic())
        return self._open.id

    def task_id(self, stage: str, base: str) -> str:
        """A fresh task id for a sleep order of ``stage`` in the open hand-over: ``base`` for
        its first, then ``base-oN`` (a worker replays its cached Ack for an id it has seen)."""
        assert self._open is not None, "open() a hand-over first"
        n = self._open.orders.get(stage, 0)
        self._open.orders[stage] = n + 1
        return base if n == 0 else f"{base}-o{n + 1}"

    def launch(self, order: SleepOrder, work: Coroutine[Any, Any, SleepResult]) -> None:
        """Run one sleep order as a task of the open hand-over."""
        assert self._open is not None, "open() a hand-over first"
        assert order.stage not in self._tasks, f"{order.stage} has a sleep in flight"
        if order.releases_memory:
            self._open.sleepers.add(order.stage)
        task = asyncio.create_task(work, name=f"sleep-{order.stage}")
        self._tasks[order.stage] = (order, task)
        task.add_done_callback(self._done)

    def fences(self, orders: tuple[FenceOrder, ...] | list[FenceOrder]) -> None:
        """Fence orders of the open hand-over: each stage must be confirmed gone first."""
        assert self._open is not None, "open() a hand-over first"
        self._open.sleepers |= {o.stage for o in orders}

    async def settle(self, wait_s: float) -> None:
        """Wait for this round's sleeps: all of them when not in the background; else those
        without requests in flight when ordered, for at most ``wait_s``."""
        if self.background:
            tasks = [t for o, t in self._tasks.values() if o.inflight_requests == 0]
            timeout: float | None = wait_s
        else:
            tasks = [t for _, t in self._tasks.values()]
            timeout = None
        if not tasks:
            return
        self._waiting = True
        try:
            await asyncio.wait(tasks, timeout=timeout)
        finally:
            self._waiting = False

    def collect(self) -> list[SleepResult]:
        """The results of the sleeps that ended, to count into the open hand-over. A sleep
        that ended with ``LeadershipLost`` raises it (after taking every ended task): the
        round stops ordering; its stage stays outstanding while the hand-over is open."""
        out: list[SleepResult] = []
        lost: BaseException | None = None
        for stage, (_, task) in list(self._tasks.items()):
            if not task.done():
                continue
            del self._tasks[stage]
            if task.cancelled():
                continue
            exc = task.exception()
            if isinstance(exc, LeadershipLost):
                lost = exc
            elif exc is not None:  # _guarded_sleep turns every other error into a result
                lost = lost or exc
            else:
                out.append(task.result())
        if lost is not None:
            raise lost
        return out

    def record(self, slept: list[SleepResult], fenced: list[FenceResult]) -> None:
        """Count ok ACKs and confirmed fences into the open hand-over."""
        o = self._open
        if o is None:
            return
        o.acked |= {r.order.stage for r in slept if r.ok}
        o.fenced |= {r.order.stage for r in slept if r.fenced}
        o.fenced |= {r.order.stage for r in fenced if r.fenced}

    def close_if_idle(self) -> None:
        """End the open hand-over once none of its sleeps runs (its results were planned with)."""
        if not self._tasks:
            self._open = None

    def cancel(self) -> None:
        """Cancel every sleep task (the operator stops)."""
        for _, task in self._tasks.values():
            task.cancel()

    def _done(self, task: asyncio.Task[Any]) -> None:
        if not self._waiting and self._on_done is not None and not task.cancelled():
            self._on_done()
