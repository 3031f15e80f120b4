"""An ASGI app served by uvicorn inside the worker's own event loop (the OpenAI API, /metrics)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import uvicorn

__all__ = ["InLoopServer"]


class _Server(uvicorn.Server):
    """uvicorn inside the worker's loop: the worker's own SIGTERM handling stays in charge."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class InLoopServer:
    """Serves one uvicorn ``config`` as a task of the running loop; ``what`` names it in errors."""

    def __init__(self, config: uvicorn.Config, what: str) -> None:
        self._server = _Server(config)
        self._what = what
        self._task: asyncio.Task[None] | None = None
        self.port = 0

    async def start(self) -> int:
        """Bind and serve; the bound port."""
        self._task = asyncio.ensure_future(self._server.serve())
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise RuntimeError(f"the {self._what} server ended before it started")
            await asyncio.sleep(0.01)
        self.port = int(self._server.servers[0].sockets[0].getsockname()[1])
        return self.port

    async def stop(self) -> None:
        """Stop accepting, let open responses end (within the config's grace), close."""
        if self._task is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
