"""The worker: one model, its state and measurements, and the requests that use them.

The concerns around it each have their module: :mod:`.loading` (the model and the initial
state), :mod:`.sleep_wake` (Sleep and WakeUp carried out, measured and acked; the decisions are
:mod:`.transitions`), :mod:`.status` (the GetStatus answer), :mod:`.lane` (the threads that run
the engine and the model). Here: the state and its listeners, FAILED, measuring, Generate.

Requests to an OnDemand worker that is asleep or in a transition are held (:mod:`.demand`)
until it is Active, then served in arrival order.

The peak device memory while Active (since the last wake or load) is measured after each
Generate and reported in GetStatus and in every Ack.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc

from omnistage.worker.v1 import inference_service_pb2, sleep_service_pb2, types_pb2
from omnistage_worker import limits
from omnistage_worker.config import WorkerConfig
from omnistage_worker.control import chunk_sinks, loading, termination
from omnistage_worker.control.component_sleep import asleep_components
from omnistage_worker.control.demand import Demand
from omnistage_worker.control.lane import DaemonLane
from omnistage_worker.control.queued import Queued, ShuttingDown
from omnistage_worker.control.sleep_wake import SleepWake
from omnistage_worker.control.status import build_status
from omnistage_worker.control.transitions import (
    Current,
    Refused,
    generate_refusal,
    holdable,
    require_epoch,
)
from omnistage_worker.engine import activity
from omnistage_worker.engine.claims import HandedPieces
from omnistage_worker.memory import MemoryProbe, Reading
from omnistage_worker.metrics import WorkerMetrics
from omnistage_worker.runners.base import (
    ChunkSink,
    InvalidRequest,
    ModelRunner,
    SleepController,
    TextChunkSink,
)

log = logging.getLogger(__name__)

Listener = Callable[[Current], Awaitable[None]]
T = TypeVar("T")


class Worker:
    """State, memory and transitions of one worker process."""

    def __init__(self, config: WorkerConfig, runner: ModelRunner) -> None:
        self.config = config
        self.runner = runner
        self.identity = config.identity
        self.controller: SleepController | None = None
        self.probe: MemoryProbe | None = None
        self.baseline = 0
        # Per device (by name): the memory measured before any weights loaded.
        self.baselines: dict[str, int] = {}
        self._state: types_pb2.WorkerState.ValueType = types_pb2.WORKER_STATE_LOADING
        self._level = 0
        self.error = ""
        self._inflight = 0
        self.idle = asyncio.Event()  # set while no Generate is in flight
        self.idle.set()
        self._listeners: list[Listener] = []
        self.last_ack: types_pb2.Ack | None = None
        self.active_footprint = 0
        # The most device memory measured while Active since the last wake or load.
        self.peak_active = 0
        # The highest leadership epoch obeyed (0: none seen); a pod starts at ``--epoch``.
        self.epoch = config.epoch
        # FAILED because memory was still used after a sleep (a later Sleep re-checks).
        self._residual_failed = False
        self._last_reading: Reading | None = None
        self.loaded = asyncio.Event()
        # Transitions (and the load) run on one thread, Generate calls on another.
        self.transition_lane = DaemonLane("omnistage-transitions")
        # One thread per request the runner takes at once (a batching runner: its batch). A
        # request beyond that waits here, where it can still leave (its client went, or the
        # worker shuts down), not in the runner's own queue, which it could not leave.
        self._generate_lane = DaemonLane("omnistage-generate", runner.max_concurrency)
        self._sleep_wake = SleepWake(self)
        self.demand = Demand(config.activation, config.hold_timeout_s, config.max_held)
        self.metrics = WorkerMetrics(self)
        self.demand.on_served = self.metrics.hold_seconds.observe
        # Admitted requests not finished; set once a shutdown began (new ones are refused).
        self.queued = Queued()
        self.terminating = False

    # -- state ----------------------------------------------------------------------------

    @property
    def current(self) -> Current:
        return Current(self._state, self._level, self.error, self._residual_failed)

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
        """The sum of the per-device bounds (each device: its baseline + the slack)."""
        return self.baseline + self.config.residual_slack * max(1, len(self.baselines))

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener`` after every state change (health follows the state this way)."""
        self._listeners.append(listener)

    async def set_state(self, state: types_pb2.WorkerState.ValueType, level: int) -> None:
        if (state, level) != (self._state, self._level):
            log.info(
                "state %s -> %s (level %d)",
                types_pb2.WorkerState.Name(self._state),
                types_pb2.WorkerState.Name(state),
                level,
            )
        self._state, self._level = state, level
        if state == types_pb2.WORKER_STATE_ACTIVE:
            self.demand.release()  # before any await: held requests go first, in order
        self.demand.changed()
        for listener in self._listeners:
            await listener(self.current)

    async def fail(self, error: str, level: int | None = None, residual: bool = False) -> None:
        """FAILED with ``error``; ``residual``: only the measured residual after a sleep failed
        (the weights are off the device at ``level``, and a later Sleep measures again)."""
        self.error = error
        self._residual_failed = residual
        log.error("worker failed: %s", error)
        # Shown in the pod's status if the container ends while failed (liveness does that).
        termination.write(self.config.termination_log, f"worker failed: {error}")
        await self.set_state(types_pb2.WORKER_STATE_FAILED, self._level if level is None else level)

    def clear_residual_failure(self) -> None:
        """A sleep measured again within the bound: the residual failure is over."""
        if self._residual_failed:
            self.error = ""
            self._residual_failed = False
            termination.write(self.config.termination_log, "")

    def require_controller(self) -> SleepController:
        if self.controller is None:
            raise Refused(grpc.StatusCode.UNAVAILABLE, "worker is loading the model")
        return self.controller

    # -- measuring ------------------------------------------------------------------------

    def measure(self) -> Reading:
        assert self.probe is not None
        reading = self.probe.read()
        self._last_reading = reading
        return reading

    def snapshot(self) -> Reading | None:
        """A fresh reading, or the last one when measuring fails or nothing is loaded yet."""
        if self.probe is None or self._sleep_wake.busy:
            # During a transition the engine is moving tensors: report the last measurement.
            return self._last_reading
        try:
            reading = self.measure()
        except Exception:
            log.exception("memory measurement failed")
            return self._last_reading
        if self._state == types_pb2.WORKER_STATE_ACTIVE:
            self.note_peak(reading)
        return reading

    def note_peak(self, reading: Reading) -> None:
        """Count a reading taken while the weights are on the device into the active peak."""
        self.peak_active = max(self.peak_active, reading.used)

    def _measure_peak(self) -> None:
        """Measure now (after a Generate, before any cache release) into the active peak."""
        if self.probe is None:
            return
        try:
            self.note_peak(self.measure())
        except Exception:
            log.exception("memory measurement after a request failed")

    def release_cached(self) -> None:
        """Return cached device blocks to the driver (blocking: run it on the transition lane)."""
        if self.probe is not None:
            self.probe.release_cached()

    # -- loading, transitions, status -----------------------------------------------------

    async def load(self) -> None:
        """Load the model and bring it to the initial state; FAILED with the reason on error."""
        await loading.load(self)

    async def sleep(
        self,
        task_id: str,
        level: int,
        epoch: int = 0,
        drain_timeout: float | None = None,
        components: Sequence[str] = (),
    ) -> types_pb2.Ack:
        """Sleep at ``level``; the Ack of this task id (replayed when seen before).

        ``drain_timeout`` (seconds) bounds the wait for in-flight requests instead of
        ``--drain-timeout``. A drain that runs out leaves the worker as it was and answers a
        not-ok Ack; like every Ack it is final for its task id (a repeat replays it), so the
        operator retries under a new task id, after a backoff.
        """
        return await self._sleep_wake.sleep(task_id, level, epoch, drain_timeout, components)

    async def wake(
        self,
        task_id: str,
        epoch: int = 0,
        claim_limit: int = 0,
        handed: HandedPieces | None = None,
    ) -> types_pb2.Ack:
        """Wake up; the Ack of this task id (replayed when seen before). ``claim_limit``: an
        overlapped wake under that limit, taking the pieces ``handed`` over where it can
        (``control/overlap.py``)."""
        return await self._sleep_wake.wake(task_id, epoch, claim_limit, handed)

    def raise_claim_limit(
        self, task_id: str, limit: int, epoch: int = 0
    ) -> sleep_service_pb2.RaiseClaimLimitResponse:
        """Raise the claim limit of the overlapped wake running under ``task_id``."""
        return self._sleep_wake.raise_claim_limit(task_id, limit, epoch)

    def status(self, epoch: int = 0) -> sleep_service_pb2.GetStatusResponse:
        """Everything GetStatus reports, measured now.

        ``epoch`` is the reader's leadership epoch: reading never needs a current epoch, but a
        higher one is remembered as obeyed, so a leader that read this worker's status fences
        the leader it replaced here before it orders anything.
        """
        require_epoch(epoch)
        self._sleep_wake.witness(epoch)
        return build_status(self)

    # -- inference ------------------------------------------------------------------------

    async def generate(
        self,
        request: inference_service_pb2.GenerateRequest,
        on_chunk: ChunkSink | None = None,
        on_admitted: Callable[[], None] | None = None,
        on_text_chunk: TextChunkSink | None = None,
    ) -> inference_service_pb2.GenerateResponse:
        """Serve one request now, hold it (OnDemand, asleep or in a transition), or refuse it
        with the reason (never dropped silently). ``on_chunk`` gets AR output's ids and text as
        generated (on the event loop), ``on_text_chunk`` the same as ``TextChunk`` messages
        (with log probabilities); ``on_admitted`` is called once past holding and validation."""
        self.admissible(request)
        receiver = chunk_sinks.chunk_receiver(on_chunk, on_text_chunk)
        sink = chunk_sinks.thread_safe(self.metrics.first_token(receiver, time.monotonic()))
        engine: Any = getattr(self.runner, "agenerate", None)  # an engine's own batching
        via_engine = lambda: engine(request, chunk_sinks.ids_and_text(on_chunk, on_text_chunk))  # noqa: E731
        response: inference_service_pb2.GenerateResponse = await self.serve_call(
            request.request_id,
            lambda: self.runner.generate(request, sink),
            via_engine if engine is not None else None,
            on_admitted,
        )
        self.metrics.served(response)
        return response

    def admissible(self, request: inference_service_pb2.GenerateRequest) -> None:
        """Refuse a request that cannot be served here whatever the state (Refused)."""
        if self.terminating:
            raise ShuttingDown("it arrived after the shutdown began")
        try:
            limits.check(self.config.limits, request, self.runner)
            self.runner.validate(request)
        except (InvalidRequest, limits.OverLimit) as exc:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from exc

    async def serve_call(
        self,
        request_id: str,
        call: Callable[[], T],
        call_async: Callable[[], Awaitable[T]] | None,
        on_admitted: Callable[[], None] | None,
    ) -> T:
        """Hold or refuse until servable, then ``call`` on the lane (``call_async``: the loop)."""
        self.demand.touch()
        deadline = time.monotonic() + self.demand.hold_timeout
        while (refusal := generate_refusal(self.current)) is not None:
            if not (self.demand.on_demand and holdable(self.current)):
                raise refusal
            await self.demand.hold(deadline)
        asleep = asleep_components(self.controller)
        if asleep:
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"components asleep: {', '.join(asleep)}; wake the worker first",
            )
        self._inflight += 1
        self.idle.clear()
        ticket = self.queued.enter()
        self.demand.changed()
        if on_admitted is not None:
            on_admitted()

        probe = self.probe

        def serve() -> T | None:
            if not ticket.start():
                return None  # it left the queue (client gone, or answered at shutdown)
            # on the lane's thread: a simulated device charges the request's activations
            serving = probe.serving() if probe is not None else contextlib.nullcontext()
            with serving, activity.REQUESTS.busy():  # the host copy's pinning steps aside
                return call()

        async def run() -> T | None:
            try:
                if call_async is not None:
                    if not ticket.start():
                        return None  # it left the queue (client gone, or answered at shutdown)
                    return await call_async()
                return await self._generate_lane.run(serve)
            finally:
                self.queued.done(ticket)
                self._inflight -= 1
                if self._inflight == 0:
                    self.idle.set()
                # Synchronous, so it runs before a draining sleep moves anything.
                self._measure_peak()
                self.demand.touch()

        # The model keeps running if the caller goes away once it started (a sleep waits for
        # it either way); a caller that goes before leaves the queue.
        job = asyncio.ensure_future(run())
        job.add_done_callback(_retrieved)
        try:
            either: set[asyncio.Future[Any]] = {job, ticket.refused}
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            if ticket.leave():
                log.info("request %s left the queue: its caller went away", request_id)
                self.demand.changed()
            raise
        if not job.done():
            ticket.refused.result()  # raises the refusal it was answered with
        response = job.result()
        if response is None:
            raise ShuttingDown()
        return response

    def terminate(self) -> int:
        """The worker is going: refuse new requests, answer the held and queued ones
        (:class:`ShuttingDown`); running ones go on. How many were answered."""
        self.terminating = True
        refusal = ShuttingDown()
        answered = self.demand.refuse_all(refusal) + self.queued.refuse_waiting(refusal)
        log.info("shutting down: %d held or queued requests answered (retry elsewhere)", answered)
        self.demand.changed()
        return answered

    async def admit(self) -> None:
        """Hold (OnDemand, asleep or in a transition) or refuse like :meth:`generate`, then count
        one request in flight; the caller ends it with :meth:`finished`. For a runner whose
        engine serves its own API (vLLM): the worker gates it without running it."""
        self.demand.touch()
        deadline = time.monotonic() + self.demand.hold_timeout
        while (refusal := generate_refusal(self.current)) is not None:
            if not (self.demand.on_demand and holdable(self.current)):
                raise refusal
            await self.demand.hold(deadline)
        self._inflight += 1
        self.idle.clear()
        self.demand.changed()

    def finished(self) -> None:
        """One admitted request is over (a draining sleep goes on once none is left)."""
        self._inflight -= 1
        if self._inflight == 0:
            self.idle.set()
        self.demand.touch()

    async def aclose(self, within: float = 30.0) -> None:
        """Free the engine's buffers, leave the device, end the worker threads.

        The engine is closed on its own thread and waited for: a process that exits while a
        thread is inside torch's C++ code aborts.
        """
        try:
            await asyncio.wait_for(self.transition_lane.run(self.runner.close), within)
        except Exception:
            log.exception("closing the runner failed")
        close = getattr(self.controller, "close", None)
        if callable(close):
            try:
                await asyncio.wait_for(self.transition_lane.run(close), within)
            except Exception:
                log.exception("closing the weight engine failed")
        if self.probe is not None:
            self.probe.close()
        self.transition_lane.close()
        self._generate_lane.close()


def _retrieved(job: asyncio.Future[Any]) -> None:
    """Mark a finished job's exception as seen (its caller may have gone)."""
    if not job.cancelled():
        job.exception()
