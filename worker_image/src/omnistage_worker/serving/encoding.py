"""Encode: an AR stage run as a pipeline's text encoder, through the worker's request path
(held while an OnDemand stage sleeps, validated, queued and drained exactly as Generate)."""

from __future__ import annotations

import grpc

from omnistage.worker.v1 import inference_service_pb2
from omnistage_worker.control.transitions import Refused
from omnistage_worker.state import Worker


async def encode(
    worker: Worker, request: inference_service_pb2.EncodeRequest
) -> inference_service_pb2.EncodeResponse:
    """The prompt's embeds from the worker's runner (UNIMPLEMENTED when it cannot encode)."""
    encoder = getattr(worker.runner, "encode", None)
    if encoder is None:
        raise Refused(
            grpc.StatusCode.UNIMPLEMENTED,
            f"a {type(worker.runner).__name__} stage cannot encode (AR transformers stages do)",
        )
    worker.admissible(
        inference_service_pb2.GenerateRequest(request_id=request.request_id, prompt=request.prompt)
    )

    def run() -> inference_service_pb2.EncodeResponse:
        response: inference_service_pb2.EncodeResponse = encoder(request)
        return response

    return await worker.serve_call(request.request_id, run, None, None)
