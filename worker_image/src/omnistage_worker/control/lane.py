"""Long-lived daemon threads that run blocking calls in order, for asyncio callers."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class DaemonLane:
    """Long-lived daemon threads (one by default) that start blocking calls in order.

    Long-lived, so the engine and the model always run on the same threads (no per-call thread
    and its allocator arena); daemon, so a call stuck past ``close``'s bound never holds up
    process exit. With several threads, up to that many calls run at once (a batching runner's
    requests each wait on one while the runner's own thread runs them together).
    """

    def __init__(self, name: str, threads: int = 1) -> None:
        self._calls: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._serve, daemon=True, name=f"{name}-{i}" if i else name)
            for i in range(max(1, threads))
        ]
        for thread in self._threads:
            thread.start()

    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            call()

    def close(self, within: float = 30.0) -> None:
        """End the threads once the calls already queued have run, and wait for them (bounded).

        Waiting matters: a process that finalizes while a thread is still inside torch's
        C++ code aborts ("terminate called without an active exception", exit -6)."""
        for _ in self._threads:
            self._calls.put(None)
        deadline = time.monotonic() + within
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))

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
