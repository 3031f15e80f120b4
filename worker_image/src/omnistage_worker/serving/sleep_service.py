"""SleepService: Sleep, WakeUp and GetStatus over the worker."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from omnistage.worker.v1 import sleep_service_pb2, sleep_service_pb2_grpc, types_pb2
from omnistage_worker.control.transitions import (
    Refused,
    drain_timeout_from_proto,
    level_from_proto,
    require_task_id,
)
from omnistage_worker.state import Worker

Context = Any  # grpc.aio.ServicerContext (grpc ships no type stubs)


class SleepServicer(sleep_service_pb2_grpc.SleepServiceServicer):
    """Thin gRPC layer: validates the request, then lets the worker act and measure.

    Refusals (no state change, task id not remembered): INVALID_ARGUMENT for a bad field
    (named first in the message: ``task_id``, ``level``, ``epoch``, ``drain_timeout``);
    FAILED_PRECONDITION for an order from an older epoch, a failed worker (its error in the
    message), a level the model cannot sleep at; UNAVAILABLE while the model loads.
    """

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    async def Sleep(
        self, request: sleep_service_pb2.SleepRequest, context: Context
    ) -> sleep_service_pb2.SleepResponse:
        async def order() -> types_pb2.Ack:
            task_id = require_task_id(request.task_id)
            level = level_from_proto(request.level)
            drain_timeout = drain_timeout_from_proto(
                request.drain_timeout.ToNanoseconds() / 1e9
                if request.HasField("drain_timeout")
                else None
            )
            return await self.worker.sleep(
                task_id, level, request.epoch, drain_timeout, list(request.components)
            )

        return sleep_service_pb2.SleepResponse(ack=await _ack(order, context))

    async def WakeUp(
        self, request: sleep_service_pb2.WakeUpRequest, context: Context
    ) -> sleep_service_pb2.WakeUpResponse:
        async def order() -> types_pb2.Ack:
            return await self.worker.wake(require_task_id(request.task_id), request.epoch)

        return sleep_service_pb2.WakeUpResponse(ack=await _ack(order, context))

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
