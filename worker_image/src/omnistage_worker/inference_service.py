"""InferenceService: Generate, refused with the reason while the worker cannot serve."""

from __future__ import annotations

import logging
from typing import Any

import grpc

from omnistage.worker.v1 import inference_service_pb2, inference_service_pb2_grpc
from omnistage_worker.state import Worker
from omnistage_worker.transitions import Refused

log = logging.getLogger(__name__)
Context = Any  # grpc.aio.ServicerContext (grpc ships no type stubs)


class InferenceServicer(inference_service_pb2_grpc.InferenceServiceServicer):
    """Every request is answered: an output, or a status that says why not."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    async def Generate(
        self, request: inference_service_pb2.GenerateRequest, context: Context
    ) -> inference_service_pb2.GenerateResponse:
        try:
            return await self.worker.generate(request)
        except Refused as exc:
            await context.abort(exc.code, exc.message)
        except Exception as exc:
            log.exception("generate %r failed", request.request_id)
            await context.abort(grpc.StatusCode.INTERNAL, f"generation failed: {exc}")
        raise AssertionError("unreachable: context.abort raises")
