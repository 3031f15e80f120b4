"""Chunk sinks for streamed Generate: one receiver for the caller's sinks, a thread-safe hop
onto the event loop (several chunks in one hand-over when a batch streams), and ids-and-text
fed from TextChunks (the shapes an engine streams)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from omnistage.worker.v1 import inference_service_pb2
from omnistage_worker.runners.base import ChunkSink, TextChunkSink
from omnistage_worker.runners.chunk_hop import HoppingSink, Receiver

log = logging.getLogger(__name__)


def chunk_receiver(
    on_chunk: ChunkSink | None, on_text_chunk: TextChunkSink | None
) -> TextChunkSink | None:
    """One sink that hands each chunk to whichever receivers the caller gave (None: none)."""
    if on_chunk is None and on_text_chunk is None:
        return None

    def receive(chunk: inference_service_pb2.TextChunk) -> None:
        if on_chunk is not None:
            on_chunk(list(chunk.token_ids), chunk.text)
        if on_text_chunk is not None:
            on_text_chunk(chunk)

    return receive


@dataclass(frozen=True)
class LoopHop:
    """Hands chunks to receivers on ``loop``: one ``call_soon_threadsafe`` per call of
    :meth:`send`, however many chunks it carries."""

    loop: asyncio.AbstractEventLoop

    def send(self, deliveries: Sequence[tuple[Receiver, inference_service_pb2.TextChunk]]) -> None:
        self.loop.call_soon_threadsafe(_deliver, list(deliveries))


def _deliver(deliveries: list[tuple[Receiver, inference_service_pb2.TextChunk]]) -> None:
    """On the loop: each chunk to its receiver, in order (one failing receiver stops no other)."""
    for receiver, chunk in deliveries:
        try:
            receiver(chunk)
        except Exception:
            log.exception("a chunk receiver failed")


def thread_safe(sink: TextChunkSink | None) -> TextChunkSink | None:
    """``sink`` called on the current event loop, from whichever thread generates (a batching
    runner hands a step's chunks for this loop over at once: :mod:`.chunk_hop`)."""
    if sink is None:
        return None
    return HoppingSink(LoopHop(asyncio.get_running_loop()), sink)


def ids_and_text(
    on_chunk: ChunkSink | None, on_text_chunk: TextChunkSink | None
) -> ChunkSink | None:
    """``on_chunk``, else ``on_text_chunk`` fed from the ids and text an engine streams."""
    if on_chunk is not None or on_text_chunk is None:
        return on_chunk
    sink = on_text_chunk

    def put(ids: list[int], text: str) -> None:
        sink(inference_service_pb2.TextChunk(token_ids=ids, text=text))

    return put
