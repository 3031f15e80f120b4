"""Leader election on its own thread, event loop and API connection.

The Lease must be renewed on time whatever the hand-over rounds are doing. On the operator's
event loop a renew waits behind every round, status patch and watch event that is ready before
it, and shares their HTTP connection pool: a storm of rounds (or one long synchronous stretch)
can hold it past the renew deadline, and the leader steps down under exactly the load it must
carry. ``ElectionThread`` runs the ``Elector`` (its renew loop, its deadline watch and its
Events) on a thread with its own asyncio loop and its own kr8s client, so a renew needs only the
GIL, which a busy loop hands over every switch interval (5 ms).

It is the operator's ``Leadership``: ``leading()`` and ``epoch`` read the elector's state
(plain attribute reads, safe across threads). Callbacks that touch the operator's objects are
the caller's to hand back to the operator's loop (``loop.call_soon_threadsafe``). A process that
is stopped as a whole (SIGSTOP, a frozen VM) stops this thread too, so it still loses the Lease.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable

from omnistage_operator.k8s.claim_keeper import ClaimKeeper
from omnistage_operator.k8s.leader import Elector

__all__ = ["ElectionThread"]

log = logging.getLogger(__name__)


class ElectionThread:
    """Runs the elector that ``build`` makes (in the thread, so its API client is the
    thread's own) until ``stop``, then releases the Lease. ``claims``: the shard's namespace
    claims, renewed on this thread on the election's cadence while the elector leads."""

    def __init__(
        self, build: Callable[[], Awaitable[Elector]], claims: ClaimKeeper | None = None
    ) -> None:
        self._build = build
        self.claims = claims
        self._elector: Elector | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="leader-election", daemon=True)

    # -- Leadership --------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The elector's epoch (0 before it first acquired the Lease)."""
        return self._elector.epoch if self._elector is not None else 0

    def leading(self) -> bool:
        """The elector's ``leading()``: held and renewed within the renew deadline."""
        return self._elector is not None and self._elector.leading()

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self, timeout_s: float = 30.0) -> None:
        """Start the thread; return once the elector is built (raise what building raised)."""
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"leader election not ready within {timeout_s}s")
        if self._error is not None:
            raise self._error

    def _main(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        try:
            elector = await self._build()
        except BaseException as exc:  # handed to start()'s caller
            self._error = exc
            self._ready.set()
            return
        self._elector = elector
        self._ready.set()
        tasks = [asyncio.create_task(elector.run()), asyncio.create_task(elector.watch_deadline())]
        if self.claims is not None:
            tasks.append(asyncio.create_task(self.claims.run(elector)))
        try:
            await self._stopping.wait()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self.claims is not None:  # the shard's rounds stopped with its leading
                await self.claims.release()
            await elector.release()

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Step down (the Lease is released) and end the thread."""
        loop, stopping = self._loop, self._stopping
        if loop is None or stopping is None or not self._thread.is_alive():
            return
        loop.call_soon_threadsafe(stopping.set)
        await asyncio.to_thread(self._thread.join, timeout_s)
        if self._thread.is_alive():
            log.warning("leader election thread did not end within %ss", timeout_s)
