"""The serialized hand-over loop of each colocation group (``GroupLoops``, mixed into
``runner.GroupRunner``): ``kick`` marks a group dirty and its loop runs rounds until nothing new
was asked (kicks during a round coalesce into one more round), polls again while something is in
progress, backs off after a failed round, and comes back when a crash or wake back-off ends.
``settled`` waits for the end of the round that takes a kick (a spec handler returns then, so
kopf's own write of the change lands after the hand-over, not in the middle of it). A loop that
ends with no kick pending calls ``loop_ended``: the runner drops a group whose stages are all
gone there (``group_forget``), with its follow-up, never in the middle of a round.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from omnistage_operator.k8s import metrics

__all__ = ["GroupLoops"]

log = logging.getLogger(__name__)

GroupKey = tuple[str, str]  # (namespace, group)
# While this many rounds run at once (the operator's API request slots: rounds wait on each
# other), a settled group's resync comes this many times less often.
BUSY_ROUNDS = 32
BUSY_STRETCH = 6.0


@dataclass
class _Loop:
    dirty: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    followup: asyncio.TimerHandle | None = None
    backoff_s: float = 0.2
    last_round: float = float("-inf")  # monotonic end of the group's last round
    started: int = 0  # rounds begun
    ended: int = 0  # rounds ended, whatever their outcome
    waiters: list[tuple[int, asyncio.Future[None]]] = field(default_factory=list)


class GroupLoops:
    """Loop half of ``GroupRunner`` (the attributes below are the runner's)."""

    _loops: dict[GroupKey, _Loop]
    _retry_in: dict[GroupKey, float]
    _in_round: int  # rounds running now, every group's
    round: Callable[[str, str], Awaitable[bool]]

    @property
    def storming(self) -> bool:
        """``BUSY_ROUNDS`` rounds or more running at once: a storm, whose rounds wait on each
        other for the API request slots and the loop."""
        return self._in_round >= BUSY_ROUNDS

    def kick_all(self) -> None:
        """Ask for a round of every group seen so far (e.g. on becoming the leader)."""
        for namespace, group in list(self._loops):
            self.kick(namespace, group, "leading")

    def kick_namespace(self, namespace: str, cause: str) -> None:
        """Ask for a round of every group seen so far in ``namespace``."""
        for ns, group in list(self._loops):
            if ns == namespace:
                self.kick(ns, group, cause)

    def kick(self, namespace: str, group: str, cause: str = "event") -> None:
        """Ask for a round of the group (coalesced with one in progress); ``cause`` counts
        the round under what asked for it first (``omnistage_round_kicks_total``)."""
        loop = self._loops.setdefault((namespace, group), _Loop())
        if not loop.dirty.is_set():
            metrics.ROUND_KICKS.labels(cause).inc()
        loop.dirty.set()
        if loop.task is None or loop.task.done():
            loop.task = asyncio.create_task(self._run(namespace, group, loop))

    def resync(self, namespace: str, group: str, interval_s: float) -> bool:
        """A resync timer fired (one per stage): kick the group unless one of its rounds is
        running or ended within most of ``interval_s``, so a group gets one resync round per
        interval whatever its stage count, and none while events keep it busy. A round that
        outlasts the interval (a storm's hand-over waiting for API slots) reads the group
        itself: a resync kicked during it would only run a second round right after it.
        While ``BUSY_ROUNDS`` rounds or more are running (a storm), the interval is
        ``BUSY_STRETCH`` times longer: a settled group's resync rounds took the CPU, the API
        slots and the workers' time the storm's hand-overs wait for, one every interval for as
        long as the storm lasted (at 2000 stages most of a storm's rounds). True: kicked."""
        loop = self._loops.get((namespace, group))
        if loop is None:
            self.kick(namespace, group, "resync")
            return True
        stretch = BUSY_STRETCH if self.storming else 1.0
        if loop.started > loop.ended or loop.dirty.is_set():
            return False
        if time.monotonic() - loop.last_round < 0.9 * interval_s * stretch:
            return False
        self.kick(namespace, group, "resync")
        return True

    async def settled(self, namespace: str, group: str, within_s: float) -> bool:
        """Wait until the round that takes the group's latest kick has ended: True, or False
        when it did not within ``within_s`` (or no kick is pending)."""
        loop = self._loops.get((namespace, group))
        if loop is None or not loop.dirty.is_set():
            return False
        target = loop.started + 1  # the next round to begin clears the kick
        done = asyncio.get_running_loop().create_future()
        entry = (target, done)
        loop.waiters.append(entry)
        try:
            await asyncio.wait_for(asyncio.shield(done), within_s)
        except TimeoutError:
            return False
        finally:
            if entry in loop.waiters:
                loop.waiters.remove(entry)
        return True

    @staticmethod
    def _ended(loop: _Loop) -> None:
        loop.ended += 1
        for target, done in list(loop.waiters):
            if target <= loop.ended and not done.done():
                done.set_result(None)

    def rounds_idle(self) -> None:
        """A round ended and none runs now (overridden by the runner)."""

    def loop_ended(self, namespace: str, group: str, loop: _Loop) -> None:
        """The group's loop ended with no kick pending (a follow-up may be; overridden by the
        runner)."""

    def _followup(self, namespace: str, group: str, loop: _Loop, delay: float, cause: str) -> None:
        if loop.followup is not None:
            loop.followup.cancel()
        loop.followup = asyncio.get_running_loop().call_later(
            delay, self.kick, namespace, group, cause
        )

    async def _run(self, namespace: str, group: str, loop: _Loop) -> None:
        while loop.dirty.is_set():
            loop.dirty.clear()
            loop.started += 1
            self._in_round += 1
            try:
                busy = await self.round(namespace, group)
                loop.last_round = time.monotonic()
            except Exception:
                log.exception("round of group %s/%s failed; retrying", namespace, group)
                metrics.ROUNDS.labels(namespace, group, "error").inc()
                loop.backoff_s = min(loop.backoff_s * 2, 5.0)
                self._followup(namespace, group, loop, loop.backoff_s, "error")
                return
            finally:
                self._in_round -= 1
                self._ended(loop)
                if not self._in_round:
                    self.rounds_idle()
            retry = self._retry_in.pop((namespace, group), None)
            if busy:
                self._followup(namespace, group, loop, loop.backoff_s, "busy")
                loop.backoff_s = min(loop.backoff_s * 1.5, 2.0)
            else:
                loop.backoff_s = 0.2
                if retry is not None:  # a crash back-off ends: create the stage's pod then
                    self._followup(namespace, group, loop, retry + 0.05, "retry")
        if self._loops.get((namespace, group)) is loop:
            self.loop_ended(namespace, group, loop)
