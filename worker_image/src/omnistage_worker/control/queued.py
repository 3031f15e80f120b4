"""Admitted requests that wait for the model, and answering them when they must leave.

A request past holding gets a :class:`Ticket` and waits for its turn on the model. Until the
model takes it (:meth:`Ticket.start`, on the thread that runs the model) it can leave: its
client went away (it no longer counts as demand, the model never runs it), or the worker is
shutting down (it is answered at once with :class:`ShuttingDown`: 503 + Retry-After, gRPC
UNAVAILABLE + ``retry-after``; a router retries it on the stage's next pod because it never
reached a model). Once started it runs to the end.
"""

from __future__ import annotations

import asyncio
import threading

import grpc

from omnistage_worker.control.transitions import Refused

SHUTDOWN_RETRY_AFTER_S = 1.0
# HTTP header on an answer whose request never reached a model (a router may send it elsewhere).
UNSERVED_HEADER = "x-omnistage-unserved"


class ShuttingDown(Refused):
    """The worker is going (fenced or replaced); the request was not served: retry elsewhere."""

    def __init__(self, what: str = "the request was not served") -> None:
        super().__init__(
            grpc.StatusCode.UNAVAILABLE,
            f"worker shutting down: {what}; retry (the stage's next pod serves it)",
            retry_after=SHUTDOWN_RETRY_AFTER_S,
        )


class Ticket:
    """One admitted request until the model takes it (or it leaves first)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._started = False
        self._left = False
        self.refused: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    @property
    def started(self) -> bool:
        return self._started

    @property
    def waiting(self) -> bool:
        """Admitted, not taken by the model, not gone."""
        return not (self._started or self._left)

    def start(self) -> bool:
        """The model takes the request now (any thread); False when it already left."""
        with self._lock:
            if self._left:
                return False
            self._started = True
            return True

    def leave(self, refusal: Refused | None = None) -> bool:
        """Leave before the model takes it (event loop); False when it already started.

        ``refusal`` answers the waiting caller (None: the caller is gone).
        """
        with self._lock:
            if self._started or self._left:
                return False
            self._left = True
        if refusal is not None and not self.refused.done():
            self.refused.set_exception(refusal)
            self.refused.exception()  # retrieved here: the caller may be gone meanwhile
        return True


class Queued:
    """The tickets of every admitted request not finished yet."""

    def __init__(self) -> None:
        self._tickets: set[Ticket] = set()

    def __len__(self) -> int:
        """How many requests wait for the model."""
        return sum(1 for t in self._tickets if t.waiting)

    def enter(self) -> Ticket:
        ticket = Ticket()
        self._tickets.add(ticket)
        return ticket

    def done(self, ticket: Ticket) -> None:
        self._tickets.discard(ticket)

    def refuse_waiting(self, refusal: Refused) -> int:
        """Answer every request the model has not taken with ``refusal``; how many."""
        return sum(1 for t in list(self._tickets) if t.leave(refusal))
