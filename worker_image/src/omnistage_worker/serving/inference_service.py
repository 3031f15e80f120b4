"""InferenceService: Generate and GenerateStream, refused with the reason while the worker
cannot serve (held first when the stage is OnDemand)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc

from omnistage.worker.v1 import inference_service_pb2, inference_service_pb2_grpc
from omnistage_worker.control.demand import retry_after_header
from omnistage_worker.control.transitions import Refused
from omnistage_worker.serving.encoding import encode
from omnistage_worker.state import Worker

log = logging.getLogger(__name__)
Context = Any  # grpc.aio.ServicerContext (grpc ships no type stubs)


class InferenceServicer(inference_service_pb2_grpc.InferenceServiceServicer):
    """Every request is answered: an output, or a status that says why not.

    A refusal that may pass (held past the hold timeout, a full hold queue) carries a
    ``retry-after`` trailer in whole seconds.
    """

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    async def Generate(
        self, request: inference_service_pb2.GenerateRequest, context: Context
    ) -> inference_service_pb2.GenerateResponse:
        try:
            return await self.worker.generate(request)
        except Refused as exc:
            await _abort(context, exc)
        except Exception as exc:
            log.exception("generate %r failed", request.request_id)
            await context.abort(grpc.StatusCode.INTERNAL, f"generation failed: {exc}")
        raise AssertionError("unreachable: context.abort raises")

    async def Encode(
        self, request: inference_service_pb2.EncodeRequest, context: Context
    ) -> inference_service_pb2.EncodeResponse:
        try:
            return await encode(self.worker, request)
        except Refused as exc:
            await _abort(context, exc)
        except Exception as exc:
            log.exception("encode %r failed", request.request_id)
            await context.abort(grpc.StatusCode.INTERNAL, f"encoding failed: {exc}")
        raise AssertionError("unreachable: context.abort raises")

    async def GenerateStream(
        self, request: inference_service_pb2.GenerateStreamRequest, context: Context
    ) -> AsyncIterator[inference_service_pb2.GenerateStreamResponse]:
        chunks: asyncio.Queue[inference_service_pb2.TextChunk] = asyncio.Queue()

        task = asyncio.ensure_future(
            self.worker.generate(request.request, on_text_chunk=chunks.put_nowait)
        )
        try:
            while not task.done() or not chunks.empty():
                getter = asyncio.ensure_future(chunks.get())
                either: set[asyncio.Future[Any]] = {getter, task}
                await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
                if getter.done():
                    yield inference_service_pb2.GenerateStreamResponse(chunk=getter.result())
                else:
                    getter.cancel()
            response = task.result()
        except Refused as exc:
            await _abort(context, exc)
            return
        except Exception as exc:
            log.exception("generate stream %r failed", request.request.request_id)
            await context.abort(grpc.StatusCode.INTERNAL, f"generation failed: {exc}")
            return
        yield inference_service_pb2.GenerateStreamResponse(done=response)


async def _abort(context: Context, refused: Refused) -> None:
    if refused.retry_after is not None:
        context.set_trailing_metadata((("retry-after", retry_after_header(refused.retry_after)),))
    await context.abort(refused.code, refused.message)
