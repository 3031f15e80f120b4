"""Threads a benchmark starts together and waits for (closed-loop clients, one copy per device)."""

from __future__ import annotations

import threading
from collections.abc import Callable


def run_threads(count: int, target: Callable[[int], object]) -> None:
    """``target(i)`` for each ``i`` below ``count``, each on its own thread, all started before
    the first is joined; returns once every one has ended."""
    threads = [threading.Thread(target=target, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
