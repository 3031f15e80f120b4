"""Streamed chunks handed to another thread in batches: one hand-over per decode step.

A request's chunk sink usually runs on the worker's event loop while the model runs on a thread
of its own, so every chunk is a hand-over to the loop (a wake-up of it, and a turn of the GIL).
A batch of rows made one per row per token. A :class:`HoppingSink` names where its receiver
runs (its :class:`ChunkHop`); :func:`hand_over` sends the chunks of one step that share a hop
in one hand-over, in order, and calls other sinks directly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

from omnistage.worker.v1 import inference_service_pb2

log = logging.getLogger(__name__)

TextChunk = inference_service_pb2.TextChunk
Receiver = Callable[[TextChunk], None]


class ChunkHop(Hashable, Protocol):
    """Where receivers run (an event loop): delivers chunks to them there, in order, all of one
    call in one hand-over. Equal hops are one place."""

    def send(self, deliveries: Sequence[tuple[Receiver, TextChunk]]) -> None: ...


@dataclass(frozen=True)
class HoppingSink:
    """A chunk sink whose ``receiver`` runs behind ``hop``; called alone, one hand-over."""

    hop: ChunkHop
    receiver: Receiver

    def __call__(self, chunk: TextChunk) -> None:
        self.hop.send([(self.receiver, chunk)])


def hand_over(deliveries: Sequence[tuple[Receiver, TextChunk]]) -> list[Receiver]:
    """Give each chunk to its sink: those of :class:`HoppingSink` s behind one hop in one
    hand-over (in the order given), the others called in turn. The sinks that raised (their
    receiver gone: a closed loop) are returned, each once."""
    failed: dict[int, Receiver] = {}
    hops: dict[ChunkHop, list[tuple[Receiver, TextChunk, Receiver]]] = {}
    for sink, chunk in deliveries:
        if isinstance(sink, HoppingSink):
            hops.setdefault(sink.hop, []).append((sink.receiver, chunk, sink))
            continue
        try:
            sink(chunk)
        except Exception:
            log.exception("a chunk sink failed")
            failed[id(sink)] = sink
    for hop, batch in hops.items():
        try:
            hop.send([(receiver, chunk) for receiver, chunk, _ in batch])
        except Exception:
            log.exception("handing %d chunks over failed", len(batch))
            failed.update((id(sink), sink) for _, _, sink in batch)
    return list(failed.values())
