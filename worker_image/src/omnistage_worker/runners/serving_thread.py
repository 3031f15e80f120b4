"""One daemon thread that serves a queue of requests, started on the first one.

The batchers (:mod:`.decode_batch`, :mod:`.group_batch`) hold their queue under ``_cond``;
:meth:`ServingThread._enqueue` adds to it and wakes the thread, :meth:`close` lets the thread
finish what is queued. Subclasses provide :meth:`_serve`, which returns once ``_closed`` is
set and nothing is left.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable


class ServingThread(ABC):
    """A queue guarded by ``_cond`` and the one thread that serves it."""

    def __init__(self, name: str) -> None:
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._thread_name = name

    def _enqueue(self, append: Callable[[], None]) -> None:
        """Run ``append`` (which adds to the queue) under the lock and wake the thread."""
        with self._cond:
            if self._closed:
                raise RuntimeError("the batcher is closed")
            append()
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._serve, daemon=True, name=self._thread_name
                )
                self._thread.start()
            self._cond.notify()

    def close(self, within: float = 30.0) -> None:
        """Stop after the requests already queued have run (bounded wait)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(within)

    @abstractmethod
    def _serve(self) -> None:
        """Serve the queue until closed and empty."""
