"""The sleep controller of a vLLM stage: vLLM's async engine put to sleep and woken from the
worker's transition lane (:class:`VllmController`), including a pre-warmed stage's first wake,
which starts the engine (:class:`Started`)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from omnistage_worker.runners.vllm_serve import LoopBridge

log = logging.getLogger(__name__)

#: Bound on one engine call made from the transition lane (sleep, wake, reload).
ENGINE_CALL_TIMEOUT_S = 600.0


def end_lifespan(
    bridge: LoopBridge, lifespan: contextlib.AbstractAsyncContextManager[Any] | None
) -> None:
    """End vLLM's app's lifespan (if any) on the worker's loop; an error there is not the
    stop's (the engine core is stopped after it either way)."""
    if lifespan is not None:
        with contextlib.suppress(Exception):
            bridge.call(lifespan.__aexit__(None, None, None), ENGINE_CALL_TIMEOUT_S)


@dataclass(frozen=True)
class Started:
    """An engine started by the runner: the client, its app's lifespan, and what a wake takes
    on the device (weights + KV pool, measured by the start's calibration)."""

    engine: Any
    lifespan: contextlib.AbstractAsyncContextManager[Any] | None
    wake_bytes: int


@dataclass(frozen=True)
class VllmStats:
    """Figures of a vLLM transition: ``bytes_moved`` is the weights' size when they were copied
    (level 1) or reloaded (level-2 wake); vLLM itself reports no bytes."""

    bytes_moved: int
    seconds: float
    noop: bool


class VllmController:
    """Sleeps and wakes vLLM's async engine (``enable_sleep_mode``) from the transition lane.

    ``flat_bytes``: what a wake takes on the device (weights and KV cache), measured at start;
    an accounted device refuses a wake ahead of time when it does not fit. ``keeps_host_copy``:
    the engine runs the fast sleep/wake (:mod:`.vllm_wake`), whose host copy of the weights
    stays page-locked from a level-1 sleep until a level-2 sleep (it counts in
    :meth:`host_bytes` while awake too).
    """

    def __init__(
        self,
        engine: Any,
        bridge: LoopBridge,
        weights_bytes: int,
        wake_bytes: int = 0,
        *,
        lifespan: contextlib.AbstractAsyncContextManager[Any] | None = None,
        keeps_host_copy: bool = False,
        start: Callable[[], Started] | None = None,
    ) -> None:
        self._engine = engine
        self._start = start
        self._bridge = bridge
        self._lifespan = lifespan
        self._level = 0 if engine is not None else 2  # not started: nothing held anywhere
        self._weights_bytes = weights_bytes
        self.flat_bytes = wake_bytes or weights_bytes
        self._keeps_host_copy = keeps_host_copy
        # the start's calibration slept at level 1 (a pre-warmed engine has not started yet)
        self._host_kept = keeps_host_copy and engine is not None

    @property
    def level(self) -> int:
        return self._level

    @property
    def weights_bytes(self) -> int:
        return self._weights_bytes

    def _run(self, call: Callable[[], Any]) -> Any:
        return self._bridge.call(call(), ENGINE_CALL_TIMEOUT_S)

    def activate(self) -> VllmStats:
        return VllmStats(0, 0.0, True)  # vLLM loads onto the device when it is built

    def start_asleep(self, level: int) -> VllmStats:
        if self._engine is not None:
            raise RuntimeError("vLLM cannot start asleep (it takes device memory while it loads)")
        return VllmStats(0, 0.0, True)  # pre-warmed: at level 2 until the first wake starts it

    def sleep(self, level: int) -> VllmStats:
        if level <= self._level:
            return VllmStats(0, 0.0, True)
        if self._level != 0:
            # vLLM has no 1 -> 2 step that does not first take the device memory back.
            raise RuntimeError("vLLM cannot go from level 1 to level 2 without waking")
        started = time.monotonic()
        # The worker drained its requests first; nothing is left for the engine to abort.
        self._run(lambda: self._engine.sleep(level))
        self._level = level
        self._host_kept = self._keeps_host_copy and level == 1
        moved = self._weights_bytes if level == 1 else 0
        return VllmStats(moved, time.monotonic() - started, False)

    def wake(self) -> VllmStats:
        if self._level == 0:
            return VllmStats(0, 0.0, True)
        started = time.monotonic()
        if self._engine is None:
            return self._first_start(started)
        engine = self._engine
        try:
            if self._level == 2:
                self._run(lambda: engine.wake_up(tags=["weights"]))
                self._run(lambda: engine.collective_rpc("reload_weights"))
                self._run(lambda: engine.wake_up(tags=["kv_cache"]))
                self._run(engine.reset_prefix_cache)
            else:
                self._run(engine.wake_up)
        except Exception:
            # Part of the memory may be mapped again: give it back before reporting.
            log.warning("vLLM wake from level %d failed; back to sleep", self._level)
            level = self._level
            with contextlib.suppress(Exception):
                self._run(lambda: engine.sleep(level))
            raise
        self._level = 0
        return VllmStats(self._weights_bytes, time.monotonic() - started, False)

    def _first_start(self, started: float) -> VllmStats:
        """A pre-warmed stage's first wake: its engine starts now (vLLM imported already).
        A start that fails leaves nothing running (the runner stops what it started)."""
        if self._start is None:
            raise RuntimeError("this vLLM engine was not started and cannot be")
        engine = self._start()
        self._engine, self._lifespan = engine.engine, engine.lifespan
        self.flat_bytes = engine.wake_bytes or self._weights_bytes
        self._level = 0
        self._host_kept = self._keeps_host_copy  # its calibration slept at level 1
        return VllmStats(self._weights_bytes, time.monotonic() - started, False)

    def close(self) -> None:
        """End the app's lifespan, stop the engine core (its memory goes with it)."""
        if self._engine is None:
            return
        lifespan, self._lifespan = self._lifespan, None
        end_lifespan(self._bridge, lifespan)
        self._engine.shutdown()

    def device_bytes(self) -> int:
        return 0  # the engine's memory is measured on the device, never accounted here

    def host_bytes(self) -> int:
        return self._weights_bytes if self._level == 1 or self._host_kept else 0
