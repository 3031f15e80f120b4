"""A test double for device memory the worker cannot cause by itself: a causal-LM runner whose
requests leave an activation cache on the device, whose sleep can leave memory behind, and
whose requests can be held in flight.

Everything it holds is a real tensor counted by the worker's own accounting probe (the probe
sums ``device_bytes`` of the controller), so the worker measures it like any other memory.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from omnistage.worker.v1 import inference_service_pb2
from omnistage_worker.config import WorkerConfig
from omnistage_worker.runners.base import SleepController, Stats, TextChunkSink
from omnistage_worker.runners.causal_lm import CausalLMRunner

SCRATCH_PER_TOKEN = 4096  # bytes of "activations" a request keeps per new token


def _nbytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


class HeldMemoryLM(CausalLMRunner):
    """The real causal-LM runner plus memory held beside the weights.

    - ``scratch``: kept after each Generate (sized by its ``max_new_tokens``) until the next
      one or a sleep, as a caching allocator keeps a request's blocks;
    - ``leak_on_sleep``: bytes a sleep from Active leaves on the device (``leftover``), until
      the test drops them;
    - ``hold``: while set to an Event, each Generate waits for it before running;
    - ``generate_ended_at``: wall-clock time the last Generate finished.
    """

    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config)
        self.scratch: torch.Tensor | None = None
        self.leftover: torch.Tensor | None = None
        self.leak_on_sleep = 0
        self.hold: threading.Event | None = None
        self.generate_ended_at = 0.0

    def held_bytes(self) -> int:
        return _nbytes(self.scratch) + _nbytes(self.leftover)

    def build_controller(self) -> SleepController:
        return HeldMemoryController(super().build_controller(), self)

    def generate(
        self, request: inference_service_pb2.GenerateRequest, sink: TextChunkSink | None = None
    ) -> inference_service_pb2.GenerateResponse:
        if self.hold is not None and not self.hold.wait(60):
            raise RuntimeError("the test never released the held request")
        response = super().generate(request, sink)
        self.scratch = torch.ones(
            SCRATCH_PER_TOKEN * max(1, request.max_new_tokens), dtype=torch.uint8
        )
        self.generate_ended_at = time.time()
        return response


class HeldMemoryController:
    """The engine's controller; the runner's held memory counts as device memory."""

    def __init__(self, inner: SleepController, runner: HeldMemoryLM) -> None:
        self.inner = inner
        self.runner = runner

    @property
    def level(self) -> int:
        return self.inner.level

    @property
    def weights_bytes(self) -> int:
        return self.inner.weights_bytes

    def activate(self) -> Stats:
        return self.inner.activate()

    def start_asleep(self, level: int) -> Stats:
        return self.inner.start_asleep(level)

    def sleep(self, level: int) -> Stats:
        was_awake = self.inner.level == 0
        stats = self.inner.sleep(level)
        self.runner.scratch = None
        if was_awake and self.runner.leak_on_sleep:
            self.runner.leftover = torch.ones(self.runner.leak_on_sleep, dtype=torch.uint8)
        return stats

    def wake(self) -> Stats:
        return self.inner.wake()

    def device_bytes(self) -> int:
        return self.inner.device_bytes() + self.runner.held_bytes()

    def host_bytes(self) -> int:
        return self.inner.host_bytes()

    def __getattr__(self, name: str) -> Any:  # flat_bytes, close, ...
        return getattr(self.inner, name)
