"""The serialized hand-over loop of each colocation group (``GroupLoops``, mixed into
``runner.GroupRunner``): ``kick`` marks a group dirty and its loop runs rounds until nothing new
was asked (kicks during a round coalesce into one more round), polls again while something is in
progress, backs off after a failed round, and comes back when a crash or wake back-off ends.
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


@dataclass
class _Loop:
    dirty: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    followup: asyncio.TimerHandle | None = None
    backoff_s: float = 0.2
    last_round: float = float("-inf")  # monotonic end of the group's last round


class GroupLoops:
    """Loop half of ``GroupRunner`` (the attributes below are the runner's)."""

    _loops: dict[GroupKey, _Loop]
    _retry_in: dict[GroupKey, float]
    round: Callable[[str, str], Awaitable[bool]]

    def kick_all(self) -> None:
        """Ask for a round of every group seen so far (e.g. on becoming the leader)."""
        for namespace, group in list(self._loops):
            self.kick(namespace, group)

    def kick(self, namespace: str, group: str) -> None:
        """Ask for a round of the group (coalesced with one in progress)."""
        loop = self._loops.setdefault((namespace, group), _Loop())
        loop.dirty.set()
        if loop.task is None or loop.task.done():
            loop.task = asyncio.create_task(self._run(namespace, group, loop))

    def resync(self, namespace: str, group: str, interval_s: float) -> None:
        """A resync timer fired (one per stage): kick the group unless one of its rounds ended
        within most of ``interval_s``, so a group gets one resync round per interval whatever
        its stage count, and none while events keep it busy."""
        loop = self._loops.get((namespace, group))
        if loop is not None and time.monotonic() - loop.last_round < 0.9 * interval_s:
            return
        self.kick(namespace, group)

    def _followup(self, namespace: str, group: str, loop: _Loop, delay: float) -> None:
        if loop.followup is not None:
            loop.followup.cancel()
        loop.followup = asyncio.get_running_loop().call_later(delay, self.kick, namespace, group)

    async def _run(self, namespace: str, group: str, loop: _Loop) -> None:
        while loop.dirty.is_set():
            loop.dirty.clear()
            try:
                busy = await self.round(namespace, group)
                loop.last_round = time.monotonic()
            except Exception:
                log.exception("round of group %s/%s failed; retrying", namespace, group)
                metrics.ROUNDS.labels(namespace, group, "error").inc()
                loop.backoff_s = min(loop.backoff_s * 2, 5.0)
                self._followup(namespace, group, loop, loop.backoff_s)
                return
            retry = self._retry_in.pop((namespace, group), None)
            if busy:
                self._followup(namespace, group, loop, loop.backoff_s)
                loop.backoff_s = min(loop.backoff_s * 1.5, 2.0)
            else:
                loop.backoff_s = 0.2
                if retry is not None:  # a crash back-off ends: create the stage's pod then
                    self._followup(namespace, group, loop, retry + 0.05)
