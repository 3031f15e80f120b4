"""The frame of the worker's transitions: one at a time, their task ids, epochs and Acks.

- transitions run one at a time (an asyncio lock); a second one waits for the first;
- an order from an older leadership epoch than the highest obeyed is refused before the task-id
  cache is consulted, and changes nothing;
- a repeated task id joins the transition started for it and gets its Ack, marked replayed;
  a not-ok Ack is final for its task id too (the operator retries under a new id);
- every Ack is written from an :class:`~omnistage_worker.control.acks.Outcome`, remembered as the
  last one, counted and logged. :mod:`omnistage_worker.control.sleep_wake` runs Sleep and WakeUp
  inside it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import grpc

from omnistage.worker.v1 import types_pb2
from omnistage_worker.control.acks import AckCache, Outcome, TaskIdConflict, build_ack, replayed
from omnistage_worker.control.component_sleep import component_memory
from omnistage_worker.control.transitions import Refused, check_epoch
from omnistage_worker.memory import Reading

if TYPE_CHECKING:
    from omnistage_worker.control.worker_parts import WorkerParts

log = logging.getLogger(__name__)


def now() -> datetime:
    return datetime.now(UTC)


class Start:
    """When a transition began: wall clock for the Ack, monotonic clock for its duration."""

    def __init__(self) -> None:
        self.at = now()
        self.monotonic = time.monotonic()


class AckedTransitions:
    """The frame of a worker's transitions: the lock that serializes them, their task ids,
    the leadership epochs obeyed, and the Acks written."""

    def __init__(self, worker: WorkerParts) -> None:
        self.worker = worker
        self._lock = asyncio.Lock()
        self._acks = AckCache(worker.config.ack_cache_size)

    @property
    def busy(self) -> bool:
        """Whether a transition holds the lock (the engine may be moving tensors)."""
        return self._lock.locked()

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

    # -- acks -----------------------------------------------------------------------------

    def _outcome(
        self,
        task_id: str,
        operation: types_pb2.Operation.ValueType,
        before: Reading,
        after: Reading,
        start: Start,
        *,
        drain: Start | None = None,
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
            now(),
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
