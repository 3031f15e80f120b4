"""SleepService: Sleep, SleepStream, WakeUp, RaiseClaimLimit and GetStatus over the worker."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from omnistage.worker.v1 import sleep_service_pb2, sleep_service_pb2_grpc, types_pb2
from omnistage_worker.control.overlap import handoff_receiving, handoff_sender, sleep_stream
from omnistage_worker.control.transitions import (
    Refused,
    drain_timeout_from_proto,
    level_from_proto,
    require_task_id,
)
from omnistage_worker.engine import handoff
from omnistage_worker.state import Worker

Context = Any  # grpc.aio.ServicerContext (grpc ships no type stubs)


class SleepServicer(sleep_service_pb2_grpc.SleepServiceServicer):
    """Thin gRPC layer: validates the request, then lets the worker act and measure.

    Refusals (no state change, task id not remembered): INVALID_ARGUMENT for a bad field
    (named first in the message: ``task_id``, ``level``, ``epoch``, ``drain_timeout``,
    ``claim_limit_bytes``, ``sleep``, ``handoff_channel``);
    FAILED_PRECONDITION for an order from an older epoch, a failed worker (its error in the
    message), a level the model cannot sleep at, a claim limit the worker cannot wake under, a
    hand-off channel without a hand-off directory;
    UNAVAILABLE while the model loads.
    """

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    def _sleep_order(
        self, request: sleep_service_pb2.SleepRequest
    ) -> Callable[[], Awaitable[types_pb2.Ack]]:
        """The sleep ``request`` asks for, validated now, run when called."""
        task_id = require_task_id(request.task_id)
        level = level_from_proto(request.level)
        drain_timeout = drain_timeout_from_proto(
            request.drain_timeout.ToNanoseconds() / 1e9
            if request.HasField("drain_timeout")
            else None
        )
        components = list(request.components)
        return lambda: self.worker.sleep(task_id, level, request.epoch, drain_timeout, components)

    async def Sleep(
        self, request: sleep_service_pb2.SleepRequest, context: Context
    ) -> sleep_service_pb2.SleepResponse:
        async def order() -> types_pb2.Ack:
            return await self._sleep_order(request)()

        return sleep_service_pb2.SleepResponse(ack=await _ack(order, context))

    async def SleepStream(
        self, request: sleep_service_pb2.SleepStreamRequest, context: Context
    ) -> AsyncIterator[sleep_service_pb2.SleepStreamResponse]:
        try:
            if not request.HasField("sleep"):
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "sleep: required")
            if request.sleep.components:
                raise Refused(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "sleep.components: a streamed sleep puts the whole model to sleep",
                )
            order = self._sleep_order(request.sleep)
            sender = handoff_sender(request.handoff_channel, self.worker.config.gpus)
            room = self.worker.inflight == 0  # a draining request's activations may need it
            with handoff.sending(sender):
                async for message in sleep_stream(
                    self.worker.measure, lambda: asyncio.ensure_future(order()), room=room
                ):
                    yield message
        except Refused as exc:
            await context.abort(exc.code, exc.message)

    async def WakeUp(
        self, request: sleep_service_pb2.WakeUpRequest, context: Context
    ) -> sleep_service_pb2.WakeUpResponse:
        async def order() -> types_pb2.Ack:
            task_id = require_task_id(request.task_id)
            if request.claim_limit_bytes < 0:
                raise Refused(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"claim_limit_bytes: {request.claim_limit_bytes} is negative",
                )
            limit = request.claim_limit_bytes
            with handoff_receiving(request.handoff_channel, limit) as handed:
                return await self.worker.wake(task_id, request.epoch, limit, handed)

        return sleep_service_pb2.WakeUpResponse(ack=await _ack(order, context))

    async def RaiseClaimLimit(
        self, request: sleep_service_pb2.RaiseClaimLimitRequest, context: Context
    ) -> sleep_service_pb2.RaiseClaimLimitResponse:
        try:
            task_id = require_task_id(request.task_id)
            if request.claim_limit_bytes <= 0:
                raise Refused(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"claim_limit_bytes: {request.claim_limit_bytes} must be above 0",
                )
            return self.worker.raise_claim_limit(task_id, request.claim_limit_bytes, request.epoch)
        except Refused as exc:
            await context.abort(exc.code, exc.message)
        raise AssertionError("unreachable: context.abort raises")

    async def GetStatus(
        self, request: sleep_service_pb2.GetStatusRequest, context: Context
    ) -> sleep_service_pb2.GetStatusResponse:
        try:
            return self.worker.status(request.epoch)
        except Refused as exc:
            await context.abort(exc.code, exc.message)
        raise AssertionError("unreachable: context.abort raises")


async def _ack(order: Callable[[], Awaitable[types_pb2.Ack]], context: Context) -> types_pb2.Ack:
    """The Ack of ``order``, or the call aborted with the refusal's status and message."""
    try:
        return await order()
    except Refused as exc:
        await context.abort(exc.code, exc.message)
    raise AssertionError("unreachable: context.abort raises")
