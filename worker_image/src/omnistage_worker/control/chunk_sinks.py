"""Chunk sinks for streamed Generate: one receiver for the caller's sinks, a thread-safe hop
onto the event loop, and ids-and-text fed from TextChunks (the shapes an engine streams)."""

from __future__ import annotations

import asyncio

from omnistage.worker.v1 import inference_service_pb2
from omnistage_worker.runners.base import ChunkSink, TextChunkSink


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


def thread_safe(sink: TextChunkSink | None) -> TextChunkSink | None:
    """``sink`` called on the current event loop, from whichever thread generates."""
    if sink is None:
        return None
    loop = asyncio.get_running_loop()

    def forward(chunk: inference_service_pb2.TextChunk) -> None:
        loop.call_soon_threadsafe(sink, chunk)

    return forward


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
