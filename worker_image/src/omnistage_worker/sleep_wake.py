"""The worker's transitions carried out: Sleep and WakeUp, one at a time, measured, acked.

Decisions come from :mod:`omnistage_worker.transitions` (pure); this module runs them:

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
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import grpc

from omnistage.worker.v1 import types_pb2
from omnistage_worker.acks import AckCache, Outcome, TaskIdConflict, build_ack, replayed
from omnistage_worker.component_sleep import asleep_components, component_memory, groups_to_sleep
from omnistage_worker.memory import Reading
from omnistage_worker.oom import is_out_of_memory, needed_bytes, wake_allocation
from omnistage_worker.runners.base import SleepController, Stats
from omnistage_worker.transitions import (
    Plan,
    Refused,
    check_epoch,
    device_residual_error,
    plan_sleep,
    plan_wake,
    residual_error,
)

if TYPE_CHECKING:
    from omnistage_worker.state import Worker

log = logging.getLogger(__name__)

SLEEP = types_pb2.OPERATION_SLEEP
WAKE = types_pb2.OPERATION_WAKE_UP


def _now() -> datetime:
    return datetime.now(UTC)


class _Start:
    """When a transition began: wall clock for the Ack, monotonic clock for its duration."""

    def __init__(self) -> None:
        self.at = _now()
        self.monotonic = time.monotonic()


class SleepWake:
    """Sleep and WakeUp of one worker: the lock that serializes them and their task ids."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self._lock = asyncio.Lock()
        self._acks = AckCache(worker.config.ack_cache_size)

    @property
    def busy(self) -> bool:
        """Whether a transition holds the lock (the engine may be moving tensors)."""
        return self._lock.locked()

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

    async def wake(self, task_id: str, epoch: int = 0) -> types_pb2.Ack:
        """Wake up; the Ack of this task id (replayed when seen before)."""
        return await self._once(task_id, "wake-up", epoch, lambda: self._wake(task_id, epoch))

    # -- task ids and epochs --------------------------------------------------------------

    async def _once(
        self,
        task_id: str,
        key: str,
        epoch: int,
        run: Callable[[], Awaitable[types_pb2.Ack]],
    ) -> types_pb2.Ack:
        """Run ``run`` for a new task id; join (replay) the transition of a known one."""
        # A stale leader learns nothing, not even a replayed Ack; its id is not remembered.
        check_epoch(epoch, self.worker.epoch)
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
        return await asyncio.shield(task)

    def witness(self, epoch: int) -> None:
        """A reader of this worker's status leads at ``epoch``: remember it like an order's."""
        self._obey(epoch)

    def _obey(self, epoch: int) -> None:
        """Remember ``epoch`` as obeyed (epoch 0, no election, never lowers it)."""
        worker = self.worker
        if epoch > worker.epoch:
            log.info("obeying leadership epoch %d (was %d)", epoch, worker.epoch)
            worker.epoch = epoch

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
                start = _Start()
                reading = worker.measure()
                return self._finish(
                    self._outcome(task_id, SLEEP, reading, reading, start, epoch=epoch, noop=True)
                )
            if plan is Plan.RECHECK:
                # Failed its residual check: go deeper when asked, return cached blocks to the
                # device again, measure again; ASLEEP only when within the bound.
                start = _Start()
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
        drain: _Start | None = None
        if plan is Plan.SLEEP and worker.inflight:
            drain = _Start()
            if not await self._drain(timeout):
                return await self._drain_ran_out(task_id, epoch, previous, drain, within=timeout)
        start = _Start()
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
        drain: _Start,
        *,
        within: float,
    ) -> types_pb2.Ack:
        """The drain ran out: back to the state before, and a not-ok Ack (nothing moved)."""
        worker = self.worker
        start = _Start()
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
        start: _Start,
        epoch: int,
        drain: _Start | None = None,
        what: str = "sleep",
    ) -> types_pb2.Ack:
        """Move the weights off the device to ``level``, return cached blocks, measure, ack."""
        worker = self.worker
        controller = worker.require_controller()
        lane = worker.transition_lane
        moved: dict[str, Any] = {}
        try:
            stats: Stats = await lane.run(lambda: controller.sleep(level))
            await lane.run(worker.release_cached)
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
            drain: _Start | None = None
            if worker.inflight:
                drain = _Start()
                if not await self._drain(timeout):
                    previous = (types_pb2.WORKER_STATE_ACTIVE, 0)
                    return await self._drain_ran_out(
                        task_id, epoch, previous, drain, within=timeout
                    )
            start = _Start()
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

    async def _wake(self, task_id: str, epoch: int) -> types_pb2.Ack:
        worker = self.worker
        async with self._lock:
            check_epoch(epoch, worker.epoch)  # a newer leader may have been obeyed meanwhile
            plan = plan_wake(worker.current)
            self._obey(epoch)
            start = _Start()
            before = worker.measure()
            peak = worker.peak_active  # the Ack reports the peak before this transition

            def outcome(after: Reading, **extra: Any) -> Outcome:
                return self._outcome(
                    task_id, WAKE, before, after, start, epoch=epoch, peak_active=peak, **extra
                )

            if plan is Plan.NOOP and not asleep_components(worker.controller):
                return self._finish(outcome(before, noop=True))
            controller = worker.require_controller()
            shortfall, short_by = _capacity_shortfall(before, controller)
            if shortfall:
                log.warning("wake refused: %s", shortfall)
                return self._finish(outcome(before, error=shortfall, needed_bytes=short_by))
            asleep_level = worker.level
            allocation = wake_allocation(controller)
            await worker.set_state(types_pb2.WORKER_STATE_WAKING, asleep_level)

            def wake_and_measure() -> tuple[Stats, Reading]:
                # Measured in the same step: an accounted (simulated) device charges the copy
                # when it is measured, and refuses it there as a GPU refuses the allocation.
                woke = controller.wake()
                return woke, worker.measure()

            try:
                stats, after = await worker.transition_lane.run(wake_and_measure)
            except Exception as exc:
                return await self._wake_failed(controller, asleep_level, exc, allocation, outcome)
            worker.active_footprint = worker.peak_active = after.used
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

    # -- acks -----------------------------------------------------------------------------

    def _outcome(
        self,
        task_id: str,
        operation: types_pb2.Operation.ValueType,
        before: Reading,
        after: Reading,
        start: _Start,
        *,
        drain: _Start | None = None,
        **extra: Any,
    ) -> Outcome:
        """What a transition did, as of now, in the worker's current state and level.

        ``start`` is when the transition itself began; ``drain``, when a sleep began waiting
        for in-flight requests before it (the wait lasted until ``start``).
        """
        worker = self.worker
        extra.setdefault("peak_active", worker.peak_active)
        if drain is not None:
            extra["drain_started_at"] = drain.at
            extra["drain_seconds"] = max(0.0, start.monotonic - drain.monotonic)
        return Outcome(
            task_id,
            operation,
            worker.state,
            worker.level,
            before,
            after,
            start.at,
            _now(),
            time.monotonic() - start.monotonic,
            residual_bound=worker.residual_bound,
            **extra,
        )

    def _finish(self, outcome: Outcome) -> types_pb2.Ack:
        """Write ``outcome`` as the Ack, remember it as the last one, log it."""
        ack = build_ack(outcome, self.worker.identity)
        ack.components.extend(component_memory(self.worker.controller))
        self.worker.last_ack = ack
        self.worker.metrics.acked(ack)
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
            extra={
                "task_id": ack.task_id,
                "operation": _OPERATIONS[ack.operation],
                "epoch": ack.epoch,
            },
        )
        return ack


_OPERATIONS = {types_pb2.OPERATION_SLEEP: "sleep", types_pb2.OPERATION_WAKE_UP: "wake_up"}


def _capacity_shortfall(before: Reading, controller: SleepController) -> tuple[str, int]:
    """On an accounted device, refuse a wake that would not fit, as a GPU would OOM: the
    reason and how many bytes more it needs ("" and 0 when it fits)."""
    if before.source != types_pb2.MEMORY_SOURCE_ACCOUNTING:
        return "", 0
    # What the wake allocates: the engine's flat buffer (weights plus alignment padding).
    from omnistage_worker.engine.sharded import ShardedEngine

    if isinstance(controller, ShardedEngine) and len(before.devices) == len(controller.shards):
        short = []
        more = 0
        for device, shard in zip(before.devices, controller.shards, strict=True):
            need = shard.flat_bytes - shard.device_bytes()
            if need > device.free:
                short.append(f"{device.device} needs {need} bytes, {device.free} free")
                more += need - device.free
        if not short:
            return "", 0
        reason = "not enough free device memory to wake: " + "; ".join(short) + " (accounting)"
        return reason, more
    need = int(getattr(controller, "flat_bytes", controller.weights_bytes))
    need -= controller.device_bytes()
    if need <= before.free:
        return "", 0
    return (
        f"not enough free device memory to wake: need {need} bytes, "
        f"{before.free} free of {before.total} (accounting)"
    ), need - before.free
