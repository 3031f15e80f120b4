"""Requests held while an OnDemand stage sleeps, and the demand figures the operator watches.

A worker of an OnDemand stage does not refuse a request that arrives while it is asleep,
sleeping or waking: it holds it in a bounded queue until the worker is Active again (then the
held requests go on in arrival order), until the request's hold timeout (UNAVAILABLE, retry
after a second), or refuses it at once when the queue is full (RESOURCE_EXHAUSTED). Every
change of the figures wakes the watchers of :meth:`Demand.watch`; a watcher reads the latest
figures, so a slow reader never sees a backlog.

Pure asyncio, no gRPC server: the servicers and the HTTP layer translate.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc

from omnistage_worker.control.transitions import Refused

MANUAL = "manual"
ON_DEMAND = "ondemand"
POLICIES = (MANUAL, ON_DEMAND)
RETRY_AFTER_S = 1.0


@dataclass(frozen=True)
class Figures:
    """The demand of one worker at one moment (times are Unix seconds)."""

    sequence: int
    held: int
    oldest_hold_start: float | None
    last_request: float | None
    held_total: int
    served_after_hold_total: int
    hold_seconds_total: float
    hold_timeouts_total: int
    hold_full_total: int


@dataclass
class _Held:
    future: asyncio.Future[None]
    since: float  # Unix seconds, for the operator
    since_monotonic: float


class Demand:
    """Held requests, the last request time, and the watchers told of every change."""

    def __init__(
        self,
        policy: str = MANUAL,
        hold_timeout: float = 60.0,
        max_held: int = 256,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"activation policy {policy!r} (manual or ondemand)")
        self.policy = policy
        self.hold_timeout = hold_timeout
        self.max_held = max_held
        self._clock = clock
        self._held: collections.deque[_Held] = collections.deque()
        self._sequence = 0
        self._last_request: float | None = None
        self._held_total = 0
        self._served_after_hold = 0
        self._hold_seconds = 0.0
        self._timeouts = 0
        self._full = 0
        self._watchers: set[asyncio.Event] = set()
        # Told how long each held request waited once it goes on (the hold-time histogram).
        self.on_served: Callable[[float], None] = lambda seconds: None

    @property
    def on_demand(self) -> bool:
        return self.policy == ON_DEMAND

    @property
    def held(self) -> int:
        return len(self._held)

    def figures(self) -> Figures:
        return Figures(
            sequence=self._sequence,
            held=len(self._held),
            oldest_hold_start=self._held[0].since if self._held else None,
            last_request=self._last_request,
            held_total=self._held_total,
            served_after_hold_total=self._served_after_hold,
            hold_seconds_total=self._hold_seconds,
            hold_timeouts_total=self._timeouts,
            hold_full_total=self._full,
        )

    def changed(self) -> None:
        """Tell every watcher that the figures (or the worker's state) changed."""
        self._sequence += 1
        for event in self._watchers:
            event.set()

    def touch(self) -> None:
        """A request arrived or finished: the stage is in use now."""
        self._last_request = self._clock()
        self.changed()

    async def watch(self) -> AsyncIterator[Figures]:
        """The figures now, then again after every change (latest only), until cancelled."""
        event = asyncio.Event()
        self._watchers.add(event)
        try:
            while True:
                event.clear()
                yield self.figures()
                await event.wait()
        finally:
            self._watchers.discard(event)

    async def hold(self, deadline: float) -> None:
        """Wait until :meth:`release` (the worker is Active); ``deadline`` is monotonic.

        Refused with RESOURCE_EXHAUSTED when the queue is full, UNAVAILABLE past the deadline.
        """
        if len(self._held) >= self.max_held:
            self._full += 1
            self.changed()
            raise Refused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"hold queue full: {len(self._held)} requests already wait for this stage to "
                f"wake (the bound is {self.max_held}); retry later",
                retry_after=RETRY_AFTER_S,
            )
        now = time.monotonic()
        entry = _Held(asyncio.get_running_loop().create_future(), self._clock(), now)
        self._held.append(entry)
        self._held_total += 1
        self.changed()
        try:
            await asyncio.wait_for(asyncio.shield(entry.future), max(0.0, deadline - now))
        except TimeoutError:
            self._drop(entry)
            self._timeouts += 1
            self.changed()
            raise Refused(
                grpc.StatusCode.UNAVAILABLE,
                f"the stage did not wake within the hold timeout of {self.hold_timeout:g}s "
                "(the request was held, not served); retry later",
                retry_after=RETRY_AFTER_S,
            ) from None
        except asyncio.CancelledError:
            self._drop(entry)
            self.changed()
            raise
        self._served_after_hold += 1
        held = time.monotonic() - entry.since_monotonic
        self._hold_seconds += held
        self.on_served(held)

    def release(self) -> int:
        """The worker is Active: let every held request go on, oldest first; how many."""
        released = 0
        while self._held:
            entry = self._held.popleft()
            if not entry.future.done():
                entry.future.set_result(None)
                released += 1
        if released:
            self.changed()
        return released

    def refuse_all(self, refusal: Refused) -> int:
        """Answer every held request with ``refusal`` (the worker is going); how many."""
        refused = 0
        while self._held:
            entry = self._held.popleft()
            if not entry.future.done():
                entry.future.set_exception(refusal)
                refused += 1
        if refused:
            self.changed()
        return refused

    def _drop(self, entry: _Held) -> None:
        with contextlib.suppress(ValueError):
            self._held.remove(entry)


def retry_after_header(seconds: float) -> str:
    """A Retry-After value: whole seconds, at least 1."""
    return str(max(1, math.ceil(seconds)))
