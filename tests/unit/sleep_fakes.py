"""The base of the tests' stand-in SleepService servers: the overlapped hand-over's RPCs, which
the operator does not call, answer UNIMPLEMENTED as a server without them would."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc

from omnistage.worker.v1 import sleep_service_pb2, sleep_service_pb2_grpc


class SleepServiceWithoutOverlap(sleep_service_pb2_grpc.SleepServiceServicer):
    """SleepStream and RaiseClaimLimit unimplemented; subclasses give Sleep, WakeUp, GetStatus."""

    async def SleepStream(
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[sleep_service_pb2.SleepStreamResponse]:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "SleepStream")
        yield sleep_service_pb2.SleepStreamResponse()  # not reached: abort raises

    async def RaiseClaimLimit(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "RaiseClaimLimit")
