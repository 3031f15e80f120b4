"""A long-lived daemon thread that runs blocking calls in order, for asyncio callers."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class DaemonLane:
    """One long-lived daemon thread that runs blocking calls in order.

    Long-lived, so the engine and the model always run on the same threads (no per-call thread
    and its allocator arena); daemon, so a call stuck past ``close``'s bound never holds up
    process exit.
    """

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, daemon=True, name=name)
        self._thread.start()

    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            call()

    def close(self, within: float = 30.0) -> None:
        """End the thread once the calls already queued have run, and wait for it (bounded).

        Waiting matters: a process that finalizes while this thread is still inside torch's
        C++ code aborts ("terminate called without an active exception", exit -6)."""
        self._calls.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(within)

    async def run(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the lane's thread; its result or exception."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def deliver(ok: bool, value: Any) -> None:
            if future.done():
                return
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)

        def call() -> None:
            try:
                result = fn()
            except BaseException as exc:
                loop.call_soon_threadsafe(deliver, False, exc)
            else:
                loop.call_soon_threadsafe(deliver, True, result)

        self._calls.put(call)
        return await future
