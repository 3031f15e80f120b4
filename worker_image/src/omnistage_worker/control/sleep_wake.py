"""The worker's transitions carried out: Sleep and WakeUp, one at a time, measured, acked.

Decisions come from :mod:`omnistage_worker.control.transitions` (pure); this module runs them:

- transitions run one at a time (an asyncio lock); a second one waits for the first;
- an order from an older leadership epoch than the highest obeyed is refused (before the
  task-id cache is consulted, and again once the lock is held), and changes nothing;
- a sleep first refuses new Generate calls, then waits for those in flight to finish (the
  drain, bounded by the request's drain timeout or ``--drain-timeout``); the Ack times the
  drain and the transition apart;
- memory is measured before and after every transition; the Ack carries the measurements;
- a sleep whose measured residual is above the bound leaves the worker FAILED, never ASLEEP;
  a later Sleep measures again and may bring it to ASLEEP; a WakeUp is refused meanwhile;
- a repeated task id joins the transition started for it and gets its Ack, marked replayed;
  a not-ok Ack is final for its task id too (the operator retries under a new id);
- a transition runs to its end even when the caller goes away.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import grpc

from omnistage.worker.v1 import sleep_service_pb2, types_pb2
from omnistage_worker.control.acks import Outcome
from omnistage_worker.control.component_sleep import asleep_components, groups_to_sleep
from omnistage_worker.control.oom import is_out_of_memory, needed_bytes, wake_allocation
from omnistage_worker.control.overlap import ClaimLimits
from omnistage_worker.control.transition_acks import AckedTransitions, Start
from omnistage_worker.control.transitions import (
    Plan,
    Refused,
    check_epoch,
    device_residual_error,
    plan_sleep,
    plan_wake,
    residual_error,
)
from omnistage_worker.control.wake_capacity import capacity_shortfall
from omnistage_worker.engine.claims import HandedPieces
from omnistage_worker.memory import Reading
from omnistage_worker.runners.base import SleepController, Stats

if TYPE_CHECKING:
    from omnistage_worker.control.worker_parts import WorkerParts

log = logging.getLogger(__name__)

SLEEP = types_pb2.OPERATION_SLEEP
WAKE = types_pb2.OPERATION_WAKE_UP


class SleepWake(AckedTransitions):
    """Sleep and WakeUp of one worker, inside the lock, task ids and Acks of its frame."""

    def __init__(self, worker: WorkerParts) -> None:
        super().__init__(worker)
        self.claim_limits = ClaimLimits()

    async def sleep(
        self,
        task_id: str,
        level: int,
        epoch: int = 0,
        drain_timeout: float | None = None,
        components: Sequence[str] = (),
    ) -> types_pb2.Ack:
        """Sleep at ``level``; the Ack of this task id (replayed when seen before).
        ``components``: only those (the worker stays Active)."""
        if components:
            names = list(components)
            return await self._once(
                task_id,
                f"sleep level {level} components {','.join(names)}",
                epoch,
                lambda: self._sleep_components(task_id, level, epoch, drain_timeout, names),
            )
        return await self._once(
            task_id,
            f"sleep level {level}",
            epoch,
            lambda: self._sleep(task_id, level, epoch, drain_timeout),
        )

    async def wake(
        self,
        task_id: str,
        epoch: int = 0,
        claim_limit: int = 0,
        handed: HandedPieces | None = None,
    ) -> types_pb2.Ack:
        """Wake up; the Ack of this task id (replayed when seen before). ``claim_limit`` above
        0: an overlapped wake, its device memory taken piece by piece under that limit, which
        :meth:`raise_claim_limit` raises (:mod:`.overlap`), from ``handed`` where it can."""
        return await self._once(
            task_id, "wake-up", epoch, lambda: self._wake(task_id, epoch, claim_limit, handed)
        )

    def raise_claim_limit(
        self, task_id: str, limit: int, epoch: int = 0
    ) -> sleep_service_pb2.RaiseClaimLimitResponse:
        """Raise the claim limit of the overlapped wake running under ``task_id``."""
        check_epoch(epoch, self.worker.epoch)
        return self.claim_limits.raise_limit(task_id, limit)

    # -- sleep ----------------------------------------------------------------------------

    async def _sleep(
        self, task_id: str, level: int, epoch: int, drain_timeout: float | None
    ) -> types_pb2.Ack:
        worker = self.worker
        async with self._lock:
            check_epoch(epoch, worker.epoch)  # a newer leader may have been obeyed meanwhile
            plan = plan_sleep(worker.current, level)
            self._refuse_level(plan, level)
            self._obey(epoch)
            if plan is Plan.NOOP:
                start = Start()
                reading = worker.measure()
                return self._finish(
                    self._outcome(task_id, SLEEP, reading, reading, start, epoch=epoch, noop=True)
                )
            if plan is Plan.RECHECK:
                # Failed its residual check: go deeper when asked, return cached blocks to the
                # device again, measure again; ASLEEP only when within the bound.
                start = Start()
                before = worker.measure()
                target = max(level, worker.require_controller().level)
                return await self._put_to_sleep(
                    task_id,
                    target,
                    before=before,
                    start=start,
                    epoch=epoch,
                    what="sleep (re-check)",
                )
            return await self._sleep_awake(task_id, level, epoch, plan, drain_timeout)

    def _refuse_level(self, plan: Plan, level: int) -> None:
        """Refuse a level this backend or model cannot go to without taking device memory."""
        worker = self.worker
        deeper = plan is Plan.DEEPEN or (plan is Plan.RECHECK and level > worker.level)
        if deeper and not worker.runner.can_deepen:
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"level: this backend cannot go from level {worker.level} to {level} "
                "without waking (which would take device memory); wake it first",
            )
        if level == 2 and not worker.runner.supports_level2 and plan is not Plan.NOOP:
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                "level: 2 is not supported for this model (no *.safetensors files to reload from)",
            )

    async def _sleep_awake(
        self, task_id: str, level: int, epoch: int, plan: Plan, drain_timeout: float | None
    ) -> types_pb2.Ack:
        """Plan SLEEP (after draining in-flight requests) or DEEPEN: SLEEPING, then move."""
        worker = self.worker
        previous = (worker.state, worker.level)
        await worker.set_state(types_pb2.WORKER_STATE_SLEEPING, worker.level)
        timeout = worker.config.drain_timeout_s if drain_timeout is None else drain_timeout
        drain: Start | None = None
        if plan is Plan.SLEEP and worker.inflight:
            drain = Start()
            if not await self._drain(timeout):
                return await self._drain_ran_out(task_id, epoch, previous, drain, within=timeout)
        start = Start()
        before = worker.measure()
        if plan is Plan.SLEEP:
            worker.note_peak(before)  # still Active: the weights have not moved yet
        return await self._put_to_sleep(
            task_id, level, before=before, start=start, epoch=epoch, drain=drain
        )

    async def _drain(self, within: float) -> bool:
        """Wait for in-flight Generate calls to finish, for at most ``within`` seconds."""
        worker = self.worker
        log.info("sleep waits for %d in-flight request(s) (up to %gs)", worker.inflight, within)
        try:
            await asyncio.wait_for(worker.idle.wait(), within)
        except TimeoutError:
            return False
        return True

    async def _drain_ran_out(
        self,
        task_id: str,
        epoch: int,
        previous: tuple[types_pb2.WorkerState.ValueType, int],
        drain: Start,
        *,
        within: float,
    ) -> types_pb2.Ack:
        """The drain ran out: back to the state before, and a not-ok Ack (nothing moved)."""
        worker = self.worker
        start = Start()
        await worker.set_state(*previous)
        reading = worker.measure()
        worker.note_peak(reading)
        error = (
            f"in-flight requests ({worker.inflight}) did not finish within the drain "
            f"timeout of {within:g}s; the sleep was not started"
        )
        return self._finish(
            self._outcome(
                task_id, SLEEP, reading, reading, start, epoch=epoch, drain=drain, error=error
            )
        )

    async def _put_to_sleep(
        self,
        task_id: str,
        level: int,
        *,
        before: Reading,
        start: Start,
        epoch: int,
        drain: Start | None = None,
        what: str = "sleep",
    ) -> types_pb2.Ack:
        """Move the weights off the device to ``level``, return cached blocks, measure, ack."""
        worker = self.worker
        controller = worker.require_controller()
        lane = worker.transition_lane
        moved: dict[str, Any] = {}
        try:
            stats: Stats = await lane.run(lambda: controller.sleep(level))
            engine_done = time.monotonic()
            await lane.run(worker.release_cached)
            log.info(
                "%s phases: order to engine done %.4fs (engine %.4fs, %d bytes), "
                "cached release %.4fs",
                what,
                engine_done - start.monotonic,
                stats.seconds,
                stats.bytes_moved,
                time.monotonic() - engine_done,
            )
        except Exception as exc:
            log.exception("%s failed", what)
            await worker.fail(f"sleep to level {level} failed: {exc}")
            after = worker.measure()
            error = worker.error
        else:
            after = worker.measure()
            error = await self._settle_asleep(after, controller.level)
            moved = {"bytes_moved": stats.bytes_moved, "noop": stats.noop}
        return self._finish(
            self._outcome(
                task_id, SLEEP, before, after, start, epoch=epoch, drain=drain, error=error, **moved
            )
        )

    async def _settle_asleep(self, after: Reading, level: int) -> str:
        """ASLEEP at ``level`` when the measured residual is within the bound; otherwise FAILED
        (the memory may still be held, so the worker never reads as asleep). The Ack's error."""
        worker = self.worker
        unverified = str(getattr(worker.probe, "unverified", "") or "")
        if unverified:
            # Figures that read 0 would make an ok Ack claim memory freed without proof.
            error = f"the sleep cannot be verified: {unverified}"
        elif len(after.devices) > 1 and len(worker.baselines) == len(after.devices):
            slack = worker.config.residual_slack
            error = device_residual_error(after, worker.baselines, slack)
        else:
            error = residual_error(after.used, worker.residual_bound)
        if error:
            log.warning("sleep ack not ok: %s", error)
            await worker.fail(error, level=level, residual=True)
        else:
            worker.clear_residual_failure()  # measured again, and now within the bound
            await worker.set_state(types_pb2.WORKER_STATE_ASLEEP, level)
        return error

    async def _sleep_components(
        self,
        task_id: str,
        level: int,
        epoch: int,
        drain_timeout: float | None,
        names: Sequence[str],
    ) -> types_pb2.Ack:
        """Some components to ``level``: drained like a sleep, then Active again; the footprint
        is what stays resident."""
        worker = self.worker
        async with self._lock:
            check_epoch(epoch, worker.epoch)
            if worker.state != types_pb2.WORKER_STATE_ACTIVE:
                raise Refused(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    "components: only an Active worker puts components to sleep",
                )
            controller = worker.require_controller()
            groups = groups_to_sleep(controller, names)
            self._refuse_level(Plan.SLEEP, level)
            self._obey(epoch)
            await worker.set_state(types_pb2.WORKER_STATE_SLEEPING, 0)
            timeout = worker.config.drain_timeout_s if drain_timeout is None else drain_timeout
            drain: Start | None = None
            if worker.inflight:
                drain = Start()
                if not await self._drain(timeout):
                    previous = (types_pb2.WORKER_STATE_ACTIVE, 0)
                    return await self._drain_ran_out(
                        task_id, epoch, previous, drain, within=timeout
                    )
            start = Start()
            before = worker.measure()
            worker.note_peak(before)
            moved: dict[str, Any] = {}
            error = ""
            try:
                sleep = functools.partial(controller.sleep_components, groups, level)  # type: ignore[attr-defined]
                stats: Stats = await worker.transition_lane.run(sleep)
                await worker.transition_lane.run(worker.release_cached)
            except Exception as exc:
                log.exception("component sleep failed")
                await worker.fail(f"sleep of {', '.join(groups)} failed: {exc}")
                error = worker.error
            else:
                moved = {"bytes_moved": stats.bytes_moved, "noop": stats.noop}
            after = worker.measure()
            if not error:
                worker.active_footprint = worker.peak_active = after.used
                await worker.set_state(types_pb2.WORKER_STATE_ACTIVE, 0)
            return self._finish(
                self._outcome(
                    task_id,
                    SLEEP,
                    before,
                    after,
                    start,
                    epoch=epoch,
                    drain=drain,
                    error=error,
                    **moved,
                )
            )

    # -- wake -----------------------------------------------------------------------------

    async def _wake(
        self, task_id: str, epoch: int, claim_limit: int = 0, handed: HandedPieces | None = None
    ) -> types_pb2.Ack:
        worker = self.worker
        async with self._lock:
            check_epoch(epoch, worker.epoch)  # a newer leader may have been obeyed meanwhile
            plan = plan_wake(worker.current)
            start = Start()
            before = worker.measure()
            gate = None
            if claim_limit and (plan is not Plan.NOOP or asleep_components(worker.controller)):
                active = plan is Plan.NOOP  # a wake of the Active worker's asleep components
                gate = self.claim_limits.gate(
                    worker, before, task_id, claim_limit, active=active, handed=handed
                )
            self._obey(epoch)
            peak = worker.peak_active  # the Ack reports the peak before this transition

            def outcome(after: Reading, **extra: Any) -> Outcome:
                return self._outcome(
                    task_id, WAKE, before, after, start, epoch=epoch, peak_active=peak, **extra
                )

            if plan is Plan.NOOP and not asleep_components(worker.controller):
                return self._finish(outcome(before, noop=True))
            controller = worker.require_controller()
            # An overlapped wake starts before the room is free: its gate, not the device's
            # free memory now, bounds what it takes.
            shortfall, short_by = ("", 0) if gate else capacity_shortfall(before, controller)
            if shortfall:
                log.warning("wake refused: %s", shortfall)
                return self._finish(outcome(before, error=shortfall, needed_bytes=short_by))
            asleep_level = worker.level
            allocation = wake_allocation(controller)
            await worker.set_state(types_pb2.WORKER_STATE_WAKING, asleep_level)

            def wake_and_measure() -> tuple[Stats, Reading]:
                # Measured in the same step: an accounted (simulated) device charges the copy
                # when it is measured, and refuses it there as a GPU refuses the allocation.
                began = time.monotonic()
                woke = controller.wake()
                engine_done = time.monotonic()
                reading = worker.measure()
                log.info(
                    "wake phases: before the lane %.4fs, engine %.4fs (%d bytes), measure %.4fs",
                    began - start.monotonic,
                    engine_done - began,
                    woke.bytes_moved,
                    time.monotonic() - engine_done,
                )
                return woke, reading

            try:
                with self.claim_limits.running(task_id, gate):
                    stats, after = await worker.transition_lane.run(wake_and_measure)
            except Exception as exc:
                return await self._wake_failed(controller, asleep_level, exc, allocation, outcome)
            worker.active_footprint = worker.peak_active = after.used
            baseline = worker.runner.residual_baseline()  # a pre-warmed engine's, once started
            if baseline is not None:
                worker.baseline = baseline
            await worker.set_state(types_pb2.WORKER_STATE_ACTIVE, 0)
            return self._finish(outcome(after, bytes_moved=stats.bytes_moved, noop=stats.noop))

    async def _wake_failed(
        self,
        controller: SleepController,
        level: int,
        exc: Exception,
        allocation: list[int],
        outcome: Callable[..., Outcome],
    ) -> types_pb2.Ack:
        """Back to sleep at ``level`` (everything the wake put on the device freed; at level 1
        the host copy is still there) and a not-ok Ack; for an OOM (torch's, CUDA's wording,
        one device of several) also how much more the wake needed than the devices had."""
        error = f"wake from level {level} failed: {exc}"
        oom = is_out_of_memory(exc)
        if oom:
            log.warning("wake ran out of device memory; going back to sleep: %s", exc)
        else:
            log.exception("wake failed")
        await self._back_to_sleep(controller, level, error)
        after = self.worker.measure()
        needed = needed_bytes(allocation, after, str(exc)) if oom else 0
        if oom:
            error = f"{error} (needed {needed} bytes more than the device had)"
        return self._finish(outcome(after, error=error, needed_bytes=needed))

    async def _back_to_sleep(self, controller: SleepController, level: int, error: str) -> None:
        """After a failed wake: put the weights back to sleep at ``level``; FAILED if not."""
        worker = self.worker
        lane = worker.transition_lane
        try:
            await lane.run(lambda: controller.sleep(level))
            await lane.run(worker.release_cached)
            await self._settle_asleep(worker.measure(), controller.level)
        except Exception as again:
            await worker.fail(f"{error}; putting it back to sleep failed too: {again}")
