"""CUDA graphs of the running batch's plain decode steps (one new column per row).

Why: a decode step of a 16.6 GiB model reads its weights in about 4 ms on an H200, yet an eager
step took 28-34 ms there: the host launches the forward's several hundred kernels one by one
through Python, and the device waits for it. A captured graph launches them all at once.

What is captured: the model's forward for a one-column step over one :class:`.BucketCache`
(its buffers, slots and columns), reading its inputs from static buffers (token ids,
positions, the 4D mask) and writing the step's keys and values through the cache's device
column index (:attr:`.BucketCache.column`), so the same graph serves every later column of that
cache. Steps that feed prompts (joins) stay eager: their widths and padding differ each time.

When: on a cache's second plain step, if it has room for :data:`MIN_ROOM` more columns (a
cache is laid out anew when a step does not fit, the batch halves or holes are compacted, and
each layout is a new set of buffers). The capture step is itself the real step: it first runs
eagerly on the capture stream (its answer is the step's answer), then is captured (capturing
runs nothing), and later steps replay it. The graph belongs to its cache and goes with it,
its private memory pool too: when the batch ends nothing of it stays on the device, as a
sleep's residual check requires.

Captures run on a stream of the batcher's own (:func:`own_stream`), not one of PyTorch's: the
first side stream asked of PyTorch makes its whole pool of streams, about 70 MiB of device
memory kept for the process's life (measured on an H200: 708 -> 778 MiB), which a sleep's
residual check would then find; a stream made directly costs nothing measurable.

A capture that fails (a forward that waits for the host, an operation CUDA cannot capture, a
thread using the legacy default stream meanwhile) turns graphs off for the batcher with one
warning; steps go on eagerly, as before.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)

MIN_ROOM = 8
"""Columns a cache must have left for its plain step to be captured."""

Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Any], torch.Tensor]
"""(ids, positions, mask, cache) -> the last position's logits, one row per slot."""


def own_stream(device: torch.device) -> Any:
    """A CUDA stream made with ``cudaStreamCreate`` on ``device`` (kept for the process)."""
    handle = ctypes.c_void_p()
    with torch.cuda.device(device):
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        error = cudart.cudaStreamCreate(ctypes.addressof(handle))
    if int(error) != 0:
        raise RuntimeError(f"cudaStreamCreate failed: {error}")
    return torch.cuda.ExternalStream(handle.value, device=device)  # type: ignore[no-untyped-call]


def worth_capturing(plain_steps: int, room: int) -> bool:
    """Whether a cache that has run ``plain_steps`` one-column steps and has ``room`` columns
    left captures its plain step now: after one eager plain step (a cache that only ever runs
    one is not worth a capture), with room for :data:`MIN_ROOM` more."""
    return plain_steps >= 1 and room >= MIN_ROOM


@dataclass
class StepGraph:
    """One cache's captured plain step: its graph, static inputs and static logits."""

    graph: Any  # torch.cuda.CUDAGraph
    ids: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor
    logits: torch.Tensor

    def replay(
        self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """The step's logits for these inputs (valid until the next replay)."""
        self.ids.copy_(ids)
        self.positions.copy_(positions)
        self.mask.copy_(mask)
        self.graph.replay()
        return self.logits


class StepGraphs:
    """Runs plain steps through their cache's graph, capturing it when worth it."""

    def __init__(self, forward: Forward, device: torch.device, enabled: bool) -> None:
        self._forward = forward
        self._device = device
        self.enabled = enabled and device.type == "cuda"
        self._stream: Any = None
        self.captures = 0
        self.replays = 0
        self.failures = 0
        self.capture_seconds = 0.0

    def step(
        self, cache: Any, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """The plain step's logits on ``cache``: replayed, captured now, or eager (counted in
        ``cache.plain_steps``)."""
        graph: StepGraph | None = cache.graph
        done = cache.plain_steps
        cache.plain_steps += 1
        if graph is not None:
            self.replays += 1
            return graph.replay(ids, positions, mask)
        if self.enabled and worth_capturing(done, cache.columns - cache.at):
            logits = self._capture(cache, ids, positions, mask)
            if logits is not None:
                return logits
        return self._forward(ids, positions, mask, cache)

    def _capture(
        self, cache: Any, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor | None:
        """Run the step eagerly on the capture stream, then capture it onto ``cache``; the
        step's logits, or None when the capture failed (graphs are then off)."""
        began = time.perf_counter()
        main: Any = None
        try:
            main = torch.cuda.current_stream(self._device)
            ids, positions, mask = ids.clone(), positions.clone(), mask.clone()
            if self._stream is None:
                self._stream = own_stream(self._device)
            stream = self._stream
            stream.wait_stream(main)
            with torch.cuda.stream(stream):
                # The real step (it writes this column); also the warm-up CUDA asks for.
                logits = self._forward(ids, positions, mask, cache)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                captured = self._forward(ids, positions, mask, cache)
        except Exception as exc:  # any capture failure: go on eagerly
            self.enabled = False
            self.failures += 1
            log.warning("decode steps run without CUDA graphs: the capture failed: %s", exc)
            if self._stream is not None and main is not None:
                main.wait_stream(self._stream)
            return None
        main.wait_stream(stream)
        logits.record_stream(main)
        cache.graph = StepGraph(graph, ids, positions, mask, captured)
        self.captures += 1
        took = time.perf_counter() - began
        self.capture_seconds += took
        level = logging.INFO if self.captures == 1 else logging.DEBUG
        log.log(level, "decode step captured as a CUDA graph (%d slots, %d columns) in %.0f ms",
                cache.slots, cache.columns, 1000 * took)  # fmt: skip
        return logits
