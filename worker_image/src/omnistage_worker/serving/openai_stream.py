"""Server-sent events of streamed completions: the chunks of ``n`` choices as the model makes
them, each with the log probabilities of the tokens it carries (a token whose text is held
back, e.g. a possible stop sequence, has them sent with the next text), each choice's last chunk
with its finish reason (and the log probabilities not sent yet), the usage chunk when asked,
then ``[DONE]``."""

from __future__ import annotations

import asyncio
import collections
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from omnistage.worker.v1 import inference_service_pb2
from omnistage_worker.serving import openai_answers, openai_api
from omnistage_worker.serving.openai_api import Parsed

log = logging.getLogger(__name__)

Response_ = inference_service_pb2.GenerateResponse
TextChunk = inference_service_pb2.TextChunk


def sse(body: dict[str, Any] | str) -> bytes:
    """One SSE event."""
    data = body if isinstance(body, str) else json.dumps(body, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class ChunkQueue:
    """The streamed chunks of several choices, in the order they were produced."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.chunks: collections.deque[tuple[int, TextChunk]] = collections.deque()
        self.wake = asyncio.Event()

    def sinks(self) -> list[Any]:
        """One chunk sink per choice (the runner calls it on the event loop)."""

        def sink(index: int) -> Callable[[TextChunk], None]:
            def put(chunk: TextChunk) -> None:
                self.chunks.append((index, chunk))
                self.wake.set()

            return put

        return [sink(i) for i in range(self.n)]


async def sse_events(
    parsed: Parsed,
    model: str,
    chat: bool,
    tasks: list[asyncio.Future[Response_]],
    events: ChunkQueue,
) -> AsyncIterator[bytes]:
    """The stream of ``tasks`` (one per choice); the client going away cancels them."""
    finished: dict[int, Response_] = {}
    first = [True] * len(tasks)
    held: list[list[Any]] = [[] for _ in tasks]  # log probabilities not sent yet
    sent_logprobs = [0] * len(tasks)
    offsets = [0] * len(tasks)  # the tokens' text sent so far (as the unstreamed answer counts)
    try:
        while len(finished) < len(tasks):
            events.wake.clear()
            while events.chunks:
                index, chunk = events.chunks.popleft()
                held[index].extend(chunk.logprobs)
                text = chunk.text
                if text or first[index]:
                    yield sse(
                        openai_answers.chunk_body(
                            parsed,
                            model,
                            chat,
                            index=index,
                            text=text,
                            first=first[index],
                            logprobs=held[index],
                            offset=offsets[index],
                        )
                    )
                    first[index] = False
                    offsets[index] += sum(len(e.token) for e in held[index])
                    sent_logprobs[index] += len(held[index])
                    held[index] = []
            for index, task in enumerate(tasks):
                if index not in finished and task.done():
                    response = finished[index] = task.result()
                    yield sse(
                        openai_answers.final_chunk_body(
                            parsed,
                            model,
                            chat,
                            index=index,
                            response=response,
                            logprobs=response.text.logprobs[sent_logprobs[index] :],
                            offset=offsets[index],
                        )
                    )
            if len(finished) < len(tasks) and not events.chunks:
                await events.wake.wait()
    except Exception as exc:
        log.exception("streamed request %s failed", parsed.request.request_id)
        yield sse(openai_api.error_body(f"generation failed: {exc}", "server_error"))
        return
    finally:
        for task in tasks:
            task.cancel()  # the client went away: queued ones leave the queue
    if parsed.include_usage:
        ordered = [finished[i] for i in range(len(tasks))]
        yield sse(openai_answers.usage_chunk_body(parsed, model, chat, ordered))
    yield sse("[DONE]")
