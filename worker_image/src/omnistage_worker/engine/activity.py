"""The worker's model runs in flight, for background work that must step aside (torch-free)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class Activity:
    """Counts model runs in flight; the pinner waits for none before each chunk."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._running = 0

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Mark a model run (a request or the warm-up) for its duration."""
        with self._cond:
            self._running += 1
        try:
            yield
        finally:
            with self._cond:
                self._running -= 1
                self._cond.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """Wait until nothing runs, at most ``timeout`` seconds; whether it is idle."""
        with self._cond:
            return self._cond.wait_for(lambda: self._running == 0, timeout=timeout)


REQUESTS = Activity()
"""The worker's model runs (process-wide: one worker per process)."""
