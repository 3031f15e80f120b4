"""An overlapped wake's claim limit, and a sleep's releases as they happen (issue 23).

In an overlapped hand-over the outgoing stage's sleep gives its device memory back piece by
piece while the incoming stage's wake takes pieces, so the two copy directions run at once. The
promise holds piece by piece: the incoming worker never holds more device memory than its
caller's limit, and the caller raises the limit only by what the outgoing worker reported
released (``SleepStream``'s measured ``MemoryReleased``).

- :class:`ClaimGate`: a wake's limit and what it holds by its own count; :meth:`ClaimGate.claim`
  waits until a piece fits under the limit.
- :func:`gated` / :func:`current_gate`: the gate the running wake's buffers take their pieces
  through. A worker runs one transition at a time, so one process-wide slot is enough.
- :func:`watching_releases` / :func:`report_release`: what a sleep's buffers say as they give
  each piece back.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Protocol

CLAIM_WAIT_S = 5.0
"""How long a claim waits without its limit rising before the wake gives up. An honest sleep
beside it raises the limit with each piece it releases (milliseconds apart); a caller that went
away (a leader lost in the middle of the hand-over) raises it no more, and the wake is back
asleep in this long instead of holding its stage in Waking."""


class ClaimTimeout(RuntimeError):
    """The limit stopped rising short of the claim (the caller went away, or never released)."""


class HandedPieces(Protocol):
    """Pieces the outgoing worker hands over (``engine.handoff.Receiver``)."""

    def admitted(self, nbytes: int) -> int | None:
        """After a claim of ``nbytes`` (0: not of a piece) is admitted: a handed-over piece of
        that size, or None once every piece held has been freed."""


class ClaimGate:
    """A wake's claim limit: the most device memory its process may hold, and what it holds by
    its own count (its measured use at the start plus every piece claimed since); with
    ``handed``, the pieces the outgoing worker hands over (see :meth:`claim`)."""

    def __init__(
        self,
        limit: int,
        held: int,
        wait_s: float = CLAIM_WAIT_S,
        handed: HandedPieces | None = None,
    ) -> None:
        if limit <= 0:
            raise ValueError(f"claim limit must be above 0, got {limit}")
        self._handed = handed
        self._limit = limit
        self._claimed = held
        self._wait_s = wait_s
        self._cond = threading.Condition()
        self._cancelled = ""
        self._raised_at = 0.0  # monotonic time of the last raise (0: none yet)

    @property
    def limit(self) -> int:
        return self._limit

    @property
    def claimed(self) -> int:
        return self._claimed

    def claim(self, nbytes: int, *, piece: bool = False) -> int | None:
        """Count ``nbytes`` more as held, once they fit under the limit (waits for raises;
        :class:`ClaimTimeout` when none comes in time, or the gate is cancelled). For a
        ``piece`` of device memory, the file descriptor of one of that size handed over when
        there is one (the caller maps it and closes the descriptor instead of making memory);
        otherwise None, with every handed-over piece not taken freed first."""
        with self._cond:
            started = time.monotonic()
            while self._claimed + nbytes > self._limit:
                if self._cancelled:
                    raise ClaimTimeout(self._cancelled)
                left = max(started, self._raised_at) + self._wait_s - time.monotonic()
                if left <= 0:
                    raise ClaimTimeout(
                        f"claim limit {self._limit} bytes left no room for {nbytes} more bytes "
                        f"beside the {self._claimed} held, not raised for {self._wait_s:g} s"
                    )
                self._cond.wait(left)
            self._claimed += nbytes
        if self._handed is None:
            return None
        return self._handed.admitted(nbytes if piece else 0)

    def raise_limit(self, limit: int) -> None:
        """A higher limit (a lower one is refused: what was claimed cannot be taken back)."""
        with self._cond:
            if limit < self._limit:
                raise ValueError(f"claim limit {limit} is below the current {self._limit}")
            if limit > self._limit:
                self._raised_at = time.monotonic()
            self._limit = limit
            self._cond.notify_all()

    def cancel(self, reason: str) -> None:
        """Every waiting and later claim that does not fit fails with ``reason``."""
        with self._cond:
            self._cancelled = reason
            self._cond.notify_all()


class _Slots:
    """The process's running wake's gate and running sleep's release watcher."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.gate: ClaimGate | None = None
        self.watcher: Callable[[int], None] | None = None


_SLOTS = _Slots()


@contextlib.contextmanager
def gated(gate: ClaimGate) -> Iterator[ClaimGate]:
    """``gate`` is the one the wake inside this block takes its device memory through."""
    with _SLOTS.lock:
        if _SLOTS.gate is not None:
            raise RuntimeError("a claim gate is already installed")
        _SLOTS.gate = gate
    try:
        yield gate
    finally:
        with _SLOTS.lock:
            _SLOTS.gate = None


def current_gate() -> ClaimGate | None:
    """The running overlapped wake's gate; None for an ordinary transition."""
    return _SLOTS.gate


@contextlib.contextmanager
def watching_releases(callback: Callable[[int], None]) -> Iterator[None]:
    """``callback(nbytes)`` runs (on the releasing thread) as a sleep inside this block gives
    each piece of device memory back."""
    with _SLOTS.lock:
        _SLOTS.watcher = callback
    try:
        yield
    finally:
        with _SLOTS.lock:
            _SLOTS.watcher = None


def report_release(nbytes: int) -> None:
    """A sleep gave ``nbytes`` of device memory back to the driver."""
    watcher = _SLOTS.watcher
    if watcher is not None:
        watcher(nbytes)
