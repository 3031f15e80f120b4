"""One periodic resync for every colocation group, instead of a kopf timer per OmniStage.

A group's round re-reads its workers' facts, so status stays true without events. A kopf timer
keeps, for every object it runs on, the object's last raw body (``metadata.managedFields``
included) and a task for as long as the object exists; this loop over the stages' index keeps
nothing per stage. Every step (a tenth of the interval) asks each group with a stage that is not
being deleted for a resync (``GroupLoops.resync``: a round unless one is running or ended
within most of the interval), so a group gets one resync round per interval whatever its stage
count, none while events keep it busy, and the groups' rounds are spread by when each last ran.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable

__all__ = ["Resync"]

log = logging.getLogger(__name__)

GroupKey = tuple[str, str]  # (namespace, group)
STEPS_PER_INTERVAL = 10


class Resync:
    """Calls ``resync(namespace, group, interval_s)`` for every group of ``groups()``, every
    ``interval_s / STEPS_PER_INTERVAL`` seconds, the first step after ``initial_delay_s``."""

    def __init__(
        self,
        groups: Callable[[], Iterable[GroupKey]],
        resync: Callable[[str, str, float], None],
        interval_s: float,
        initial_delay_s: float | None = None,
    ) -> None:
        self.groups = groups
        self.resync = resync
        self.interval_s = interval_s
        self.step_s = interval_s / STEPS_PER_INTERVAL
        self.initial_delay_s = min(5.0, interval_s) if initial_delay_s is None else initial_delay_s
        self._task: asyncio.Task[None] | None = None

    def step(self) -> int:
        """Ask every group for a resync now; the number of groups asked."""
        asked = 0
        for namespace, group in self.groups():
            self.resync(namespace, group, self.interval_s)
            asked += 1
        return asked

    async def run(self) -> None:
        """Step until cancelled (a failed step is logged, the next one comes)."""
        await asyncio.sleep(self.initial_delay_s)
        while True:
            try:
                self.step()
            except Exception:
                log.exception("resync step failed")
            await asyncio.sleep(self.step_s)

    def start(self) -> None:
        """Run in the background (once)."""
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self.run(), name="resync")

    async def stop(self) -> None:
        """Cancel the loop and wait for it."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
