"""The low-priority lane of the operator's Events (``EventLane``): posted when no round runs.

In a storm the operator's CPU is what every group's hand-over waits for. An Event is news for a
user, not a step of any hand-over: posted as soon as its round's status was written, a storm's
Events (two per hand-over) took about a sixth of the operator's event-loop time while hand-overs
of other groups were still waiting (cProfile over a 400-stage hand-over storm). Here they wait
until no round is running (``idle``), and go out then, ``concurrency`` at once; none is dropped,
and one that waited ``max_hold_s`` goes out whatever runs (a loop that never falls idle does not
silence them). The Events of one object go out one at a time in the order they were put
(``key``: the involved object), so a reader of one stage's Events sees them in the order the
rounds emitted them, and the aggregation of repeats (``event_series``) decides on them in that
order. Each is posted in the context it was put with (``kube.tally_context``: its round's API
tally counts it; nothing else of the round's context is kept while it waits).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections import deque
from collections.abc import Callable, Coroutine, Hashable
from dataclasses import dataclass
from typing import Any

__all__ = ["EventLane"]

log = logging.getLogger(__name__)

Post = Callable[[], Coroutine[Any, Any, None]]


@dataclass(frozen=True)
class _Held:
    post: Post
    context: contextvars.Context
    at: float  # monotonic: when it was put


class EventLane:
    """Posts put on it once ``idle()`` (or after ``max_hold_s``), in order per key."""

    def __init__(
        self,
        idle: Callable[[], bool],
        *,
        concurrency: int = 4,
        max_hold_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._idle = idle
        self._concurrency = concurrency
        self._max_hold_s = max_hold_s
        self._clock = clock
        self._queues: dict[Hashable, deque[_Held]] = {}
        self._ready: deque[Hashable] = deque()  # keys with posts held and none in flight
        self._workers: set[asyncio.Task[None]] = set()
        self._freed = asyncio.Event()  # set by ``wake`` (a round ended with none left running)
        self._closing = False  # ``close``: post what is held without waiting for an idle loop

    def __len__(self) -> int:
        """Posts held or in flight."""
        return sum(len(q) for q in self._queues.values())

    def put(self, key: Hashable, post: Post, context: contextvars.Context | None = None) -> None:
        """Hold ``post`` (an Event's request, not started) behind the earlier ones of ``key``;
        it runs in ``context`` (an empty one when None: a held post keeps alive nothing of
        its putter's context, where kopf keeps the raw event its handler was called for)."""
        held = _Held(post, context if context is not None else contextvars.Context(), self._clock())
        queue = self._queues.get(key)
        if queue is None:
            self._queues[key] = deque([held])
            self._ready.append(key)
        else:
            queue.append(held)
        if len(self._workers) < self._concurrency and len(self._workers) < len(self._ready):
            task = asyncio.create_task(self._work(), context=contextvars.Context())
            self._workers.add(task)
            task.add_done_callback(self._workers.discard)

    def wake(self) -> None:
        """A round ended: the lane may be free now (``idle`` says)."""
        if self._queues and self._idle():
            self._freed.set()

    async def close(self, flush_s: float = 5.0) -> None:
        """The process is ending: what is held goes out now, rounds or not, for at most
        ``flush_s``; what is left then is dropped (a warning says how many)."""
        self._closing = True
        self._freed.set()
        if self._workers:
            await asyncio.wait(list(self._workers), timeout=flush_s)
        left = len(self)
        for task in list(self._workers):
            task.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        if left:
            log.warning("%d Events not posted: the operator is ending", left)
        self._queues.clear()
        self._ready.clear()

    async def _work(self) -> None:
        while self._ready:
            # the first ready key's first post is the oldest held: keys queue in the order
            # their first post was put, and a ready key has posted none of its own yet
            await self._turn(self._queues[self._ready[0]][0].at)
            if not self._ready:
                return
            key = self._ready.popleft()
            queue = self._queues[key]
            while queue:
                held = queue[0]
                await self._turn(held.at)
                try:
                    await asyncio.create_task(held.post(), context=held.context)
                except Exception:  # Events are best effort: the next ones still go out
                    log.exception("posting an Event failed")
                queue.popleft()
            del self._queues[key]

    async def _turn(self, at: float) -> None:
        """Wait until a post put at ``at`` may go: no round runs, or it waited its most (or
        the lane is closing)."""
        while not self._closing and not self._idle():
            left = at + self._max_hold_s - self._clock()
            if left <= 0:
                return
            self._freed.clear()
            try:
                await asyncio.wait_for(self._freed.wait(), left)
            except TimeoutError:
                return
