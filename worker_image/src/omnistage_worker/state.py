"""The worker: one model, its state, and the serialized transitions that move its weights.

Rules carried out here (decisions come from :mod:`omnistage_worker.transitions`):

- transitions run one at a time (an asyncio lock); a second one waits for the first;
- a sleep first refuses new Generate calls, then waits for those in flight to finish;
- memory is measured before and after every transition; the Ack carries the measurements;
- a repeated task id joins the transition started for it and gets its Ack, marked replayed;
- a transition runs to its end even when the caller goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any, TypeVar

import grpc

from omnistage.worker.v1 import inference_service_pb2, sleep_service_pb2, types_pb2
from omnistage_worker.acks import AckCache, Outcome, TaskIdConflict, build_ack, replayed
from omnistage_worker.acks import identity_proto as _identity_proto
from omnistage_worker.config import WorkerConfig
from omnistage_worker.memory import (
    AccountingProbe,
    MemoryProbe,
    Reading,
    build_probe,
    cuda_allocator,
)
from omnistage_worker.runners.base import InvalidRequest, ModelRunner, SleepController, Stats
from omnistage_worker.transitions import (
    Current,
    Plan,
    Refused,
    generate_refusal,
    plan_sleep,
    plan_wake,
    residual_error,
)

log = logging.getLogger(__name__)
_cuda_allocator = cuda_allocator  # moved to memory; tests/worker/gpu_smoke.py imports it here

SLEEP = types_pb2.OPERATION_SLEEP
WAKE = types_pb2.OPERATION_WAKE_UP


class _Start:
    """When a transition began: wall clock for the Ack, monotonic clock for its duration."""

    def __init__(self) -> None:
        self.at = _now()
        self.monotonic = time.monotonic()


T = TypeVar("T")
Listener = Callable[[Current], Awaitable[None]]

_LEVEL_PROTO = {
    0: types_pb2.SLEEP_LEVEL_UNSPECIFIED,
    1: types_pb2.SLEEP_LEVEL_OFFLOAD,
    2: types_pb2.SLEEP_LEVEL_DISCARD,
}


def _now() -> datetime:
    return datetime.now(UTC)


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


class Worker:
    """State, memory and transitions of one worker process."""

    def __init__(self, config: WorkerConfig, runner: ModelRunner) -> None:
        self.config = config
        self.runner = runner
        self.identity = config.identity
        self.controller: SleepController | None = None
        self.probe: MemoryProbe | None = None
        self.baseline = 0
        self._state: types_pb2.WorkerState.ValueType = types_pb2.WORKER_STATE_LOADING
        self._level = 0
        self._error = ""
        self._lock = asyncio.Lock()
        self._acks = AckCache(config.ack_cache_size)
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._listeners: list[Listener] = []
        self.last_ack: types_pb2.Ack | None = None
        self.active_footprint = 0
        self._last_reading: Reading | None = None
        self.loaded = asyncio.Event()
        # Transitions (and the load) run on one thread, Generate calls on another.
        self._transition_lane = DaemonLane("omnistage-transitions")
        self._generate_lane = DaemonLane("omnistage-generate")

    # -- state ----------------------------------------------------------------------------

    @property
    def current(self) -> Current:
        return Current(self._state, self._level, self._error)

    @property
    def state(self) -> types_pb2.WorkerState.ValueType:
        return self._state

    @property
    def level(self) -> int:
        return self._level

    @property
    def inflight(self) -> int:
        return self._inflight

    @property
    def residual_bound(self) -> int:
        return self.baseline + self.config.residual_slack

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener`` after every state change (health follows the state this way)."""
        self._listeners.append(listener)

    async def _set_state(self, state: types_pb2.WorkerState.ValueType, level: int) -> None:
        if (state, level) != (self._state, self._level):
            log.info(
                "state %s -> %s (level %d)",
                types_pb2.WorkerState.Name(self._state),
                types_pb2.WorkerState.Name(state),
                level,
            )
        self._state, self._level = state, level
        for listener in self._listeners:
            await listener(self.current)

    async def _fail(self, error: str) -> None:
        self._error = error
        log.error("worker failed: %s", error)
        await self._set_state(types_pb2.WORKER_STATE_FAILED, self._level)

    # -- loading --------------------------------------------------------------------------

    async def load(self) -> None:
        """Load the model and bring it to the initial state; FAILED with the reason on error."""
        try:
            await self._transition_lane.run(self._load_blocking)
        except Exception as exc:
            log.exception("loading failed")
            await self._fail(f"loading {self.config.model} failed: {exc}")
            self.loaded.set()
            return
        assert self.controller is not None
        if self.config.initial_state == "active":
            self.active_footprint = self._measure().used
            await self._set_state(types_pb2.WORKER_STATE_ACTIVE, 0)
        else:
            self._measure()
            await self._set_state(types_pb2.WORKER_STATE_ASLEEP, self.controller.level)
        self.loaded.set()

    def _load_blocking(self) -> None:
        config = self.config
        started = time.monotonic()
        self.probe = build_probe(config)
        self.probe.touch()
        self.baseline = self.probe.read().used
        log.info("device context measured: %d bytes (the residual baseline)", self.baseline)
        log.info("loading model from %s", config.model)
        self.runner.load()
        level2_start = config.initial_state == "asleep" and config.sleep_level == 2
        if level2_start and not self.runner.supports_level2:
            raise RuntimeError("--sleep-level 2 needs *.safetensors weight files to reload from")
        controller = self.runner.build_controller()
        if isinstance(self.probe, AccountingProbe):
            self.probe.set_used_fn(controller.device_bytes)
        if config.initial_state == "active":
            stats = controller.activate()
            verb = "activated"
        else:
            stats = controller.start_asleep(config.sleep_level)
            verb = f"started asleep at level {config.sleep_level}"
        self.controller = controller
        log.info(
            "model %s: %d weight bytes, %d bytes moved in %.2fs (load total %.2fs)",
            verb,
            controller.weights_bytes,
            stats.bytes_moved,
            stats.seconds,
            time.monotonic() - started,
        )

    # -- measuring ------------------------------------------------------------------------

    def _measure(self) -> Reading:
        assert self.probe is not None
        reading = self.probe.read()
        self._last_reading = reading
        return reading

    def snapshot(self) -> Reading | None:
        """A fresh reading, or the last one when measuring fails or nothing is loaded yet."""
        if self.probe is None or self._lock.locked():
            # During a transition the engine is moving tensors: report the last measurement.
            return self._last_reading
        try:
            return self._measure()
        except Exception:
            log.exception("memory measurement failed")
            return self._last_reading

    # -- transitions ----------------------------------------------------------------------

    async def sleep(self, task_id: str, level: int) -> types_pb2.Ack:
        """Sleep at ``level``; the Ack of this task id (replayed when seen before)."""
        return await self._transition(
            task_id, f"sleep level {level}", lambda: self._sleep(task_id, level)
        )

    async def wake(self, task_id: str) -> types_pb2.Ack:
        """Wake up; the Ack of this task id (replayed when seen before)."""
        return await self._transition(task_id, "wake-up", lambda: self._wake(task_id))

    async def _transition(
        self, task_id: str, key: str, run: Callable[[], Awaitable[types_pb2.Ack]]
    ) -> types_pb2.Ack:
        try:
            existing = self._acks.get(task_id, key)
        except TaskIdConflict as exc:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from exc
        if existing is not None:
            log.info("task %s repeated: returning its first ack", task_id)
            return replayed(await asyncio.shield(existing))

        async def guarded() -> types_pb2.Ack:
            try:
                return await run()
            except BaseException:
                self._acks.discard(task_id)  # refused or crashed: the id may be retried
                raise

        task = asyncio.ensure_future(guarded())
        self._acks.put(task_id, key, task)
        ack = await asyncio.shield(task)
        return ack

    async def _sleep(self, task_id: str, level: int) -> types_pb2.Ack:
        async with self._lock:
            plan = plan_sleep(self.current, level)
            if plan is Plan.DEEPEN and not self.runner.can_deepen:
                raise Refused(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"level: this backend cannot go from level {self._level} to {level} "
                    "without waking (which would take device memory); wake it first",
                )
            if level == 2 and not self.runner.supports_level2 and plan is not Plan.NOOP:
                raise Refused(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    "level: 2 is not supported for this model (no *.safetensors files to "
                    "reload from)",
                )
            start = _Start()
            if plan is Plan.NOOP:
                reading = self._measure()
                return self._finish(
                    self._outcome(task_id, SLEEP, reading, reading, start, noop=True)
                )
            previous = (self._state, self._level)
            await self._set_state(types_pb2.WORKER_STATE_SLEEPING, self._level)
            if plan is Plan.SLEEP and not await self._drain():
                await self._set_state(*previous)
                reading = self._measure()
                error = (
                    f"in-flight requests did not finish within "
                    f"{self.config.drain_timeout_s:.0f}s; the sleep was not started"
                )
                return self._finish(
                    self._outcome(task_id, SLEEP, reading, reading, start, error=error)
                )
            before = self._measure()
            controller = self._require_controller()
            try:
                stats: Stats = await self._transition_lane.run(lambda: controller.sleep(level))
                if self.probe is not None:
                    await self._transition_lane.run(self.probe.release_cached)
            except Exception as exc:
                log.exception("sleep failed")
                await self._fail(f"sleep to level {level} failed: {exc}")
                after = self._measure()
                return self._finish(
                    self._outcome(task_id, SLEEP, before, after, start, error=self._error)
                )
            after = self._measure()
            await self._set_state(types_pb2.WORKER_STATE_ASLEEP, controller.level)
            error = residual_error(after.used, self.residual_bound)
            if error:
                log.warning("sleep ack not ok: %s", error)
            return self._finish(
                self._outcome(
                    task_id,
                    SLEEP,
                    before,
                    after,
                    start,
                    bytes_moved=stats.bytes_moved,
                    noop=stats.noop,
                    error=error,
                )
            )

    async def _wake(self, task_id: str) -> types_pb2.Ack:
        async with self._lock:
            plan = plan_wake(self.current)
            start = _Start()
            before = self._measure()

            def outcome(after: Reading, **extra: Any) -> Outcome:
                return self._outcome(task_id, WAKE, before, after, start, **extra)

            if plan is Plan.NOOP:
                return self._finish(outcome(before, noop=True))
            controller = self._require_controller()
            shortfall = self._capacity_shortfall(before, controller)
            if shortfall:
                log.warning("wake refused: %s", shortfall)
                return self._finish(outcome(before, error=shortfall))
            asleep_level = self._level
            await self._set_state(types_pb2.WORKER_STATE_WAKING, asleep_level)
            try:
                stats: Stats = await self._transition_lane.run(controller.wake)
            except Exception as exc:
                log.exception("wake failed")
                error = f"wake from level {asleep_level} failed: {exc}"
                try:
                    await self._transition_lane.run(lambda: controller.sleep(asleep_level))
                    await self._set_state(types_pb2.WORKER_STATE_ASLEEP, controller.level)
                except Exception as again:
                    await self._fail(f"{error}; putting it back to sleep failed too: {again}")
                return self._finish(outcome(self._measure(), error=error))
            after = self._measure()
            self.active_footprint = after.used
            await self._set_state(types_pb2.WORKER_STATE_ACTIVE, 0)
            return self._finish(outcome(after, bytes_moved=stats.bytes_moved, noop=stats.noop))

    def _capacity_shortfall(self, before: Reading, controller: SleepController) -> str:
        """On a fake (accounting) device, refuse a wake that would not fit, as a GPU would OOM."""
        if before.source != types_pb2.MEMORY_SOURCE_ACCOUNTING:
            return ""
        # What the wake allocates: the engine's flat buffer (weights plus alignment padding).
        need = int(getattr(controller, "flat_bytes", controller.weights_bytes))
        need -= controller.device_bytes()
        if need <= before.free:
            return ""
        return (
            f"not enough free device memory to wake: need {need} bytes, "
            f"{before.free} free of {before.total} (accounting)"
        )

    def _outcome(
        self,
        task_id: str,
        operation: types_pb2.Operation.ValueType,
        before: Reading,
        after: Reading,
        start: _Start,
        **extra: Any,
    ) -> Outcome:
        """What a transition did, as of now, in the worker's current state and level."""
        return Outcome(
            task_id,
            operation,
            self._state,
            self._level,
            before,
            after,
            start.at,
            _now(),
            time.monotonic() - start.monotonic,
            residual_bound=self.residual_bound,
            **extra,
        )

    def _require_controller(self) -> SleepController:
        if self.controller is None:
            raise Refused(grpc.StatusCode.UNAVAILABLE, "worker is loading the model")
        return self.controller

    def _finish(self, outcome: Outcome) -> types_pb2.Ack:
        ack = build_ack(outcome, self.identity)
        self.last_ack = ack
        log.info(
            "ack %s task=%s ok=%s level=%d state=%s freed=%d used %d -> %d moved=%d in %.3fs%s%s",
            types_pb2.Operation.Name(ack.operation),
            ack.task_id,
            ack.ok,
            outcome.level,
            types_pb2.WorkerState.Name(ack.state),
            ack.freed_bytes,
            ack.used_before_bytes,
            ack.used_after_bytes,
            ack.bytes_moved,
            outcome.seconds,
            " (noop)" if ack.noop else "",
            f" error: {ack.error}" if ack.error else "",
        )
        return ack

    async def _drain(self) -> bool:
        """Wait for in-flight Generate calls to finish (bounded by the drain timeout)."""
        if self._inflight:
            log.info("sleep waits for %d in-flight request(s)", self._inflight)
        try:
            await asyncio.wait_for(self._idle.wait(), self.config.drain_timeout_s)
        except TimeoutError:
            return False
        return True

    # -- inference ------------------------------------------------------------------------

    async def generate(
        self, request: inference_service_pb2.GenerateRequest
    ) -> inference_service_pb2.GenerateResponse:
        """Serve one request now, or refuse it with the reason (never dropped silently)."""
        refusal = generate_refusal(self.current)
        if refusal is not None:
            raise refusal
        try:
            self.runner.validate(request)
        except InvalidRequest as exc:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from exc
        self._inflight += 1
        self._idle.clear()

        probe = self.probe

        def serve() -> inference_service_pb2.GenerateResponse:
            # on the lane's thread: a simulated device charges the request's activations
            with probe.serving() if probe is not None else contextlib.nullcontext():
                return self.runner.generate(request)

        async def run() -> inference_service_pb2.GenerateResponse:
            try:
                return await self._generate_lane.run(serve)
            finally:
                self._inflight -= 1
                if self._inflight == 0:
                    self._idle.set()

        # The model keeps running if the caller goes away; a sleep waits for it either way.
        return await asyncio.shield(asyncio.ensure_future(run()))

    # -- status ---------------------------------------------------------------------------

    def status(self) -> sleep_service_pb2.GetStatusResponse:
        """Everything GetStatus reports, measured now."""
        config = self.config
        reading = self.snapshot()
        response = sleep_service_pb2.GetStatusResponse(
            state=self._state,
            level=_LEVEL_PROTO[self._level],
            model=str(config.model),
            runner=self.runner.runner_kind,
            backend=self.runner.backend_kind,
            worker=_identity_proto(self.identity),
            weights_bytes=self.controller.weights_bytes if self.controller else 0,
            active_footprint_bytes=self.active_footprint,
            error=self._error,
            inflight_requests=self._inflight,
        )
        if reading is not None:
            response.used_bytes = reading.used
            response.free_bytes = reading.free
            response.total_bytes = reading.total
            response.source = reading.source
            for dev in reading.devices:
                response.devices.add(
                    device=dev.device,
                    index=dev.index,
                    uuid=dev.uuid,
                    used_before_bytes=dev.used,
                    used_after_bytes=dev.used,
                    free_after_bytes=dev.free,
                    total_bytes=dev.total,
                )
        if self.last_ack is not None:
            response.last_ack.CopyFrom(self.last_ack)
        return response

    async def aclose(self, within: float = 30.0) -> None:
        """Free the engine's buffers, withdraw from the memory ledger, end the worker threads.

        The engine is closed on its own thread and waited for: a process that exits while a
        thread is inside torch's C++ code aborts.
        """
        close = getattr(self.controller, "close", None)
        if callable(close):
            try:
                await asyncio.wait_for(self._transition_lane.run(close), within)
            except Exception:
                log.exception("closing the weight engine failed")
        if self.probe is not None:
            self.probe.close()
        self._transition_lane.close()
        self._generate_lane.close()
