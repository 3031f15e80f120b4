"""The worker's side of an overlapped hand-over (issue 23): a sleep that streams what it has
released, and a wake that takes its device memory piece by piece under a limit its caller
raises (:mod:`omnistage_worker.engine.claims`).

The caller (the operator, or ``bench/overlap.py``) opens the outgoing worker's ``SleepStream``
and the incoming worker's ``WakeUp`` with ``claim_limit_bytes`` at once, and raises the limit
(``RaiseClaimLimit``) by each measured release the stream reports: at no instant does the
incoming worker hold memory the outgoing one has not first reported given back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from omnistage.worker.v1 import sleep_service_pb2, types_pb2
from omnistage_worker.control.component_sleep import asleep_components
from omnistage_worker.control.transitions import Refused
from omnistage_worker.control.worker_parts import WorkerParts, WorkerReadings
from omnistage_worker.engine import claims, handoff
from omnistage_worker.engine.claims import ClaimGate, HandedPieces
from omnistage_worker.memory import Reading

log = logging.getLogger(__name__)


def claim_limit_refusal(worker: WorkerReadings, before: Reading, *, active: bool) -> str:
    """Why this worker (``active``: Active already, a wake of its asleep components) cannot
    wake piece by piece under a limit now; empty when it can (GetStatus's ``claim_limits``)."""
    if worker.runner.backend_kind == types_pb2.BACKEND_VLLM:
        return "vLLM wakes through its own sleep mode, not piece by piece"
    if not worker.runner.wakes_piece_by_piece:
        return "its engine does not take device memory piece by piece"
    if len(before.devices) > 1:
        return f"the stage holds {len(before.devices)} devices; one limit covers one device"
    if active and asleep_components(worker.controller):
        return "the worker is Active with components asleep; wake them without a limit"
    return ""


def _channel(name: str) -> Path:
    """The socket of hand-off channel ``name``, or the request refused naming the field."""
    try:
        return handoff.channel_path(name)
    except LookupError as exc:
        raise Refused(grpc.StatusCode.FAILED_PRECONDITION, f"handoff_channel: {exc}") from exc
    except ValueError as exc:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"handoff_channel: {exc}") from exc


def handoff_sender(channel: str, devices: int) -> handoff.Sender | None:
    """The sender of a streamed sleep that hands its pieces over ``channel`` (None: empty), of
    a worker on ``devices`` devices (a piece goes to a wake on the same one: one device)."""
    if not channel:
        return None
    if devices > 1:
        raise Refused(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"handoff_channel: the stage holds {devices} devices; pieces are handed over "
            "between stages on one",
        )
    return handoff.Sender(_channel(channel))


@contextlib.contextmanager
def handoff_receiving(channel: str, claim_limit: int) -> Iterator[handoff.Receiver | None]:
    """A wake under ``claim_limit`` listens on ``channel`` in this block (None: empty)."""
    if not channel:
        yield None
        return
    if claim_limit <= 0:
        raise Refused(
            grpc.StatusCode.INVALID_ARGUMENT,
            "handoff_channel: only for a wake under a claim limit (claim_limit_bytes above 0)",
        )
    path = _channel(channel)
    if handoff.listening(path):  # the first WakeUp of this task id still runs: it listens
        yield None
        return
    try:
        receiver = handoff.Receiver(path)
    except OSError as exc:
        raise Refused(
            grpc.StatusCode.FAILED_PRECONDITION, f"handoff_channel: cannot listen at {path}: {exc}"
        ) from exc
    try:
        yield receiver
    finally:
        receiver.close()
        log.info(
            "hand-off %s: %d pieces (%d bytes) taken over, %d freed unused",
            channel,
            receiver.taken_pieces,
            receiver.taken_bytes,
            receiver.dropped_pieces,
        )


EARLY_RAISES_KEPT = 64
"""Raises for a task id whose wake has not begun yet (it may still wait for the worker's lock)
are kept, this many at most, and the wake starts from the highest."""


class ClaimLimits:
    """The overlapped wakes running in this worker, by task id (one at a time in practice)."""

    def __init__(self) -> None:
        self._gates: dict[str, ClaimGate] = {}
        self._early: OrderedDict[str, int] = OrderedDict()

    def gate(
        self,
        worker: WorkerParts,
        before: Reading,
        task_id: str,
        limit: int,
        *,
        active: bool,
        handed: HandedPieces | None = None,
    ) -> ClaimGate:
        """A gate for a wake under ``limit``, or a higher one raised before it began, taking
        the pieces ``handed`` over where it can (FAILED_PRECONDITION when the worker cannot
        wake under a limit; ``active``: it is Active, the wake is of its asleep components)."""
        why = claim_limit_refusal(worker, before, active=active)
        if why:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION, f"claim_limit_bytes: {why}")
        return ClaimGate(max(limit, self._early.pop(task_id, 0)), before.used, handed=handed)

    @contextlib.contextmanager
    def running(self, task_id: str, gate: ClaimGate | None) -> Iterator[None]:
        """The wake of ``task_id`` runs under ``gate`` in this block (nothing without one)."""
        if gate is None:
            yield
            return
        self._gates[task_id] = gate
        try:
            with claims.gated(gate):
                yield
        finally:
            del self._gates[task_id]
            gate.cancel("the wake ended")

    def raise_limit(self, task_id: str, limit: int) -> sleep_service_pb2.RaiseClaimLimitResponse:
        """Raise the running wake's limit; ``running`` false when none runs under ``task_id``."""
        gate = self._gates.get(task_id)
        if gate is None:  # kept, in case its wake has yet to begin
            self._early[task_id] = max(limit, self._early.pop(task_id, 0))
            while len(self._early) > EARLY_RAISES_KEPT:
                self._early.popitem(last=False)
            return sleep_service_pb2.RaiseClaimLimitResponse(running=False)
        try:
            gate.raise_limit(limit)
        except ValueError as exc:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"claim_limit_bytes: {exc}") from exc
        return sleep_service_pb2.RaiseClaimLimitResponse(
            running=True, claimed_bytes=gate.claimed, claim_limit_bytes=gate.limit
        )


def _released(
    before: Reading, now: Reading, *, first: bool = False
) -> sleep_service_pb2.SleepStreamResponse:
    at = Timestamp()
    at.GetCurrentTime()
    released = sleep_service_pb2.MemoryReleased(
        released_bytes=max(before.used - now.used, 0), used_bytes=now.used, source=now.source, at=at
    )
    if first and len(now.devices) == 1:  # the room beside the sleeper, before it releases
        released.device_free_bytes = now.free
    return sleep_service_pb2.SleepStreamResponse(released=released)


async def sleep_stream(
    measure: Callable[[], Reading],
    sleep: Callable[[], asyncio.Future[Any]],
    *,
    room: bool = True,
) -> AsyncIterator[sleep_service_pb2.SleepStreamResponse]:
    """Run ``sleep`` and yield a measured :class:`MemoryReleased` after the pieces it gives
    back (releases that come while one is measured are reported by the next), then its Ack.
    The first one is the measurement taken before the sleep began (nothing released; with
    ``room``, the device's free memory then, for a stage on one device: left out while
    requests are in flight, whose activations may still need it as they drain).

    The sleep runs to its end even when the caller stops reading."""
    loop = asyncio.get_running_loop()
    news = asyncio.Event()
    before = measure()
    reported = 0

    def released(_nbytes: int) -> None:
        loop.call_soon_threadsafe(news.set)

    with claims.watching_releases(released):
        task = sleep()
        yield _released(before, before, first=room)
        while not task.done():
            waiter = asyncio.ensure_future(news.wait())
            await asyncio.wait([task, waiter], return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            if news.is_set():
                news.clear()
                message = _released(before, measure())
                if message.released.released_bytes > reported:
                    reported = message.released.released_bytes
                    yield message
        ack = await task
    yield sleep_service_pb2.SleepStreamResponse(ack=ack)
