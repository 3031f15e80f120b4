"""SleepService: Sleep, WakeUp and GetStatus over the worker."""

from __future__ import annotations

from typing import Any

from omnistage.worker.v1 import sleep_service_pb2, sleep_service_pb2_grpc
from omnistage_worker.state import Worker
from omnistage_worker.transitions import (
    Refused,
    drain_timeout_from_proto,
    level_from_proto,
    require_task_id,
)

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
        try:
            task_id = require_task_id(request.task_id)
            level = level_from_proto(request.level)
            drain_timeout = drain_timeout_from_proto(
                request.drain_timeout.ToNanoseconds() / 1e9
                if request.HasField("drain_timeout")
                else None
            )
            ack = await self.worker.sleep(task_id, level, request.epoch, drain_timeout)
        except Refused as exc:
            await context.abort(exc.code, exc.message)
        return sleep_service_pb2.SleepResponse(ack=ack)

    async def WakeUp(
        self, request: sleep_service_pb2.WakeUpRequest, context: Context
    ) -> sleep_service_pb2.WakeUpResponse:
        try:
            task_id = require_task_id(request.task_id)
            ack = await self.worker.wake(task_id, request.epoch)
        except Refused as exc:
            await context.abort(exc.code, exc.message)
        return sleep_service_pb2.WakeUpResponse(ack=ack)

    async def GetStatus(
        self, request: sleep_service_pb2.GetStatusRequest, context: Context
    ) -> sleep_service_pb2.GetStatusResponse:
        return self.worker.status()
