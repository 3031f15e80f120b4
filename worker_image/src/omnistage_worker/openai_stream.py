"""Server-sent events of streamed completions: the chunks of ``n`` choices as the model makes
them, each choice's last chunk with its finish reason (and its log probabilities), the usage
chunk when asked, then ``[DONE]``."""

from __future__ import annotations

import asyncio
import collections
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from omnistage.worker.v1 import inference_service_pb2
from omnistage_worker import openai_answers, openai_api
from omnistage_worker.openai_api import Parsed

log = logging.getLogger(__name__)

Response_ = inference_service_pb2.GenerateResponse


def sse(body: dict[str, Any] | str) -> bytes:
    """One SSE event."""
    data = body if isinstance(body, str) else json.dumps(body, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class ChunkQueue:
    """The streamed chunks of several choices, in the order they were produced."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.chunks: collections.deque[tuple[int, str]] = collections.deque()
        self.wake = asyncio.Event()

    def sinks(self) -> list[Any]:
        """One chunk sink per choice (the runner calls it on the event loop)."""

        def sink(index: int) -> Callable[[list[int], str], None]:
            def put(ids: list[int], text: str) -> None:
                self.chunks.append((index, text))
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
    try:
        while len(finished) < len(tasks):
            events.wake.clear()
            while events.chunks:
                index, text = events.chunks.popleft()
                if text or first[index]:
                    yield sse(
                        openai_answers.chunk_body(
                            parsed, model, chat, index=index, text=text, first=first[index]
                        )
                    )
                    first[index] = False
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
                            logprobs=response.text.logprobs,
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
