"""A pipeline behind one OpenAI name: each request runs through its stages over gRPC.

The router (:mod:`.router`) hands a request whose ``model`` is a pipeline's name here. Every
stage but the last runs as the pipeline says: ``embeds`` calls the stage's ``Encode`` and gives
its :class:`PromptEmbeds` to the next stage instead of a prompt; ``text`` calls ``Generate`` and
makes its text the next stage's prompt. The last stage gets the client's own fields (size,
steps, seed, guidance). Each stage call is an ordinary request to that stage: an OnDemand stage
that sleeps holds it, and the operator's batch policy decides when the stages swap.

Refusals keep the OpenAI error shape: a client's field refused by a stage is a 400 naming the
client's parameter; a stage refusing what the stage before it produced (a pipeline whose stages
do not fit) is a 500 naming both stages.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import grpc
from starlette.responses import JSONResponse, Response, StreamingResponse

from omnistage.worker.v1 import inference_service_pb2, inference_service_pb2_grpc
from omnistage_worker.runners.embeds import MAX_MESSAGE_BYTES
from omnistage_worker.serving import openai_answers, openai_api
from omnistage_worker.serving.image_usage import usage_of_images
from omnistage_worker.serving.openai_api import BadRequest, Parsed, error_body
from omnistage_worker.serving.openai_stream import ChunkQueue, sse_events
from omnistage_worker.serving.pipeline_def import Passes, PipelineDef

log = logging.getLogger(__name__)

GenerateRequest = inference_service_pb2.GenerateRequest
GenerateResponse = inference_service_pb2.GenerateResponse
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]
_CARRIED = frozenset({"prompt", "prompt_embeds"})  # what one stage makes for the next
FIRST_PAUSE_S, MAX_PAUSE_S = 0.25, 2.0


def _unserved(exc: grpc.aio.AioRpcError) -> bool:
    """The call never reached a model: no connection, or the worker is shutting down."""
    details = exc.details() or ""
    return exc.code() == grpc.StatusCode.UNAVAILABLE and (
        "shutting down" in details or "failed to connect" in details.lower()
    )


class StageFailed(Exception):
    """A stage refused or failed a request; the answer the client gets."""

    def __init__(self, response: JSONResponse) -> None:
        super().__init__(response.status_code)
        self.response = response


class PipelineServer:
    """Runs requests through one pipeline's stages (``targets``: stage -> gRPC host:port)."""

    def __init__(
        self, pipeline: PipelineDef, targets: Mapping[str, str], retry_within: float = 15.0
    ) -> None:
        self.pipeline = pipeline
        self.targets = {s.name: targets[s.name] for s in pipeline.stages}
        self.channels: dict[str, grpc.aio.Channel] = {}
        self.retry_within = retry_within
        self.served = 0
        self.retried = 0  # stage calls sent again because they never reached a model

    def stub(self, stage: str) -> Any:
        """The stage's InferenceService stub (its channel opened on first use, on the loop)."""
        if stage not in self.channels:
            self.channels[stage] = grpc.aio.insecure_channel(
                self.targets[stage], options=CHANNEL_OPTIONS
            )
        return inference_service_pb2_grpc.InferenceServiceStub(self.channels[stage])

    async def close(self) -> None:
        for channel in self.channels.values():
            await channel.close()
        self.channels.clear()

    async def run(
        self,
        request: GenerateRequest,
        parsed: Parsed | None = None,
        sink: Callable[[inference_service_pb2.TextChunk], None] | None = None,
    ) -> GenerateResponse:
        """One request through every stage; the last stage's response (``sink``: its text
        as the last stage generates it, over GenerateStream)."""
        prompt = request.prompt
        embeds: inference_service_pb2.PromptEmbeds | None = None
        prompt_tokens = 0  # the client's prompt, as the first stage counted it
        for index, stage in enumerate(self.pipeline.stages[:-1]):
            rid = f"{request.request_id}.{stage.name}"
            if stage.passes is Passes.EMBEDS:
                encode = inference_service_pb2.EncodeRequest(request_id=rid, prompt=prompt)
                encoded = await self._call(index, parsed, lambda s, m=encode: s.Encode(m))
                prompt, embeds = "", encoded.prompt_embeds
                prompt_tokens = prompt_tokens or encoded.usage.prompt_tokens
            else:
                first = GenerateRequest(request_id=rid, prompt=prompt, seed=request.seed)
                if embeds is not None:
                    first.prompt_embeds.CopyFrom(embeds)
                made = await self._call(index, parsed, lambda s, m=first: s.Generate(m))
                prompt, embeds = made.text.text, None
                prompt_tokens = prompt_tokens or made.usage.prompt_tokens
        final = GenerateRequest()
        final.CopyFrom(request)
        final.prompt = prompt
        if embeds is not None:
            final.prompt_embeds.CopyFrom(embeds)
        last = len(self.pipeline.stages) - 1

        async def streamed(stub: Any) -> GenerateResponse:
            request = inference_service_pb2.GenerateStreamRequest(request=final)
            async for message in stub.GenerateStream(request):
                if message.WhichOneof("event") == "chunk" and sink is not None:
                    sink(message.chunk)
                elif message.WhichOneof("event") == "done":
                    done: GenerateResponse = message.done
                    return done
            raise RuntimeError("the stream ended without its response")

        call = streamed if sink is not None else (lambda s: s.Generate(final))
        response: GenerateResponse = await self._call(last, parsed, call)
        self.served += 1
        if response.WhichOneof("output") != "text":
            response.usage.prompt_tokens = prompt_tokens
        return response

    async def _call(self, index: int, parsed: Parsed | None, call: Any) -> Any:
        """``call(stub)`` on the stage; sent again, after a pause, while the stage's worker
        could not be reached or answered that it is going (the request never reached a model,
        and behind a Service the next pod takes it), for up to ``retry_within`` seconds."""
        stage = self.pipeline.stages[index].name
        deadline = time.monotonic() + self.retry_within
        pause = FIRST_PAUSE_S
        while True:
            try:
                return await call(self.stub(stage))
            except grpc.aio.AioRpcError as exc:
                if not _unserved(exc) or time.monotonic() + pause > deadline:
                    raise StageFailed(self._refusal(index, stage, exc, parsed)) from exc
                self.retried += 1
                log.info("stage %r: %s; sending again in %.2fs", stage, exc.details(), pause)
            await asyncio.sleep(pause)
            pause = min(MAX_PAUSE_S, pause * 2)

    def _refusal(
        self, index: int, stage: str, exc: grpc.aio.AioRpcError, parsed: Parsed | None
    ) -> JSONResponse:
        details = exc.details() or ""
        code = exc.code()
        field = details.split(":", 1)[0]
        message = f"pipeline {self.pipeline.name!r}, stage {stage!r}: {details}"
        if code == grpc.StatusCode.INVALID_ARGUMENT and index > 0 and field in _CARRIED:
            before = self.pipeline.stages[index - 1].name
            body = error_body(
                f"{message} (what stage {before!r} made does not fit stage {stage!r})",
                "server_error",
                None,
                "pipeline_mismatch",
            )
            return JSONResponse(body, status_code=500)
        params = parsed.param if parsed is not None else str
        status, body = openai_api.refusal_status(code, details, params)
        body["error"]["message"] = message
        headers = {}
        for key, value in exc.trailing_metadata() or ():
            if key == "retry-after":
                headers["Retry-After"] = str(value)
        return JSONResponse(body, status_code=status, headers=headers or None)

    async def images(self, body: Any) -> Response:
        """``/v1/images/generations`` under the pipeline's name."""
        parsed = openai_api.parse_image(body, self.pipeline.name)
        responses = await self._all(parsed)
        if any(r.WhichOneof("output") != "image" for r in responses):
            raise BadRequest(None, f"pipeline {self.pipeline.name!r} makes text, not images")
        return JSONResponse(openai_answers.image_body(responses, _image_usage(parsed, responses)))

    async def text(self, body: Any, chat: bool) -> Response:
        """``/v1/chat/completions`` or ``/v1/completions`` for a pipeline whose last stage
        makes text (``stream: true``: its text as it is generated)."""
        name = self.pipeline.name
        parse = openai_api.parse_chat if chat else openai_api.parse_completion
        parsed = parse(body, name)
        if parsed.stream:
            return await self._stream(parsed, chat)
        responses = await self._all(parsed)
        if any(r.WhichOneof("output") != "text" for r in responses):
            raise BadRequest(None, f"pipeline {name!r} makes images: use /v1/images/generations")
        return JSONResponse(openai_answers.completion_body(parsed, responses, name, chat))

    async def _stream(self, parsed: Parsed, chat: bool) -> Response:
        """SSE of the last stage's text as it is generated; a refusal before its first chunk
        is an ordinary error response."""
        events = ChunkQueue(len(parsed.requests))
        sinks = events.sinks()
        tasks: list[asyncio.Future[GenerateResponse]] = [
            asyncio.ensure_future(self.run(r, parsed, sinks[i]))
            for i, r in enumerate(parsed.requests)
        ]
        for task in tasks:
            task.add_done_callback(lambda _: events.wake.set())
        waiter = asyncio.ensure_future(events.wake.wait())
        try:
            either: set[asyncio.Future[Any]] = {*tasks, waiter}
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            failed = next((t for t in tasks if t.done() and t.exception() is not None), None)
            if failed is not None:
                failed.result()  # raises StageFailed: the caller answers with it
        except BaseException:
            for task in tasks:
                task.cancel()
            raise
        finally:
            waiter.cancel()
        if any(t.done() and t.result().WhichOneof("output") != "text" for t in tasks):
            raise BadRequest(None, f"pipeline {self.pipeline.name!r} makes images")
        return StreamingResponse(
            sse_events(parsed, self.pipeline.name, chat, tasks, events),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )

    async def _all(self, parsed: Parsed) -> list[GenerateResponse]:
        calls = [asyncio.ensure_future(self.run(r, parsed)) for r in parsed.requests]
        try:
            return list(await asyncio.gather(*calls))
        finally:
            for call in calls:
                call.cancel()

    async def serve(self, path: str, body: Any) -> Response:
        """The answer to one OpenAI request (refusals in the OpenAI error shape)."""
        try:
            if path.endswith("/images/generations"):
                return await self.images(body)
            return await self.text(body, chat=path.endswith("/chat/completions"))
        except BadRequest as exc:
            return JSONResponse(
                error_body(exc.message, "invalid_request_error", exc.param, exc.code), exc.status
            )
        except StageFailed as exc:
            return exc.response


def grpc_targets(
    pipelines: list[PipelineDef], namespace: str, port: int, explicit: Mapping[str, str]
) -> dict[str, str]:
    """Stage -> gRPC host:port: ``--grpc-route STAGE=HOST:PORT``, else the stage's Service."""
    stages = {s.name for p in pipelines for s in p.stages}
    return {s: explicit.get(s, f"{s}-worker.{namespace}.svc:{port}") for s in sorted(stages)}


def _image_usage(parsed: Parsed, responses: list[GenerateResponse]) -> dict[str, Any]:
    """``usage`` in the shape a diffusion stage answers (:mod:`.image_usage`): the client's
    prompt as the pipeline's first stage counted it, once whatever ``n``; ``steps`` 0 when the
    request left them to the last stage's default."""
    prompt = responses[0].usage.prompt_tokens if responses else 0
    return usage_of_images(prompt, len(responses), parsed.request.num_inference_steps)
