"""A model runner without a model: its weights are a byte count moved on a simulated GPU.

The worker around it is the product's (state, ACKs, epochs, the residual check, demand, gRPC
services); only the engine is simulated. ``weights`` bytes go to the device on a wake (an
allocation on the :class:`~tests.scale.simgpu.SimGpu`, so a wake that does not fit is the
simulated CUDA OOM), to host memory at a level-1 sleep, nowhere at level 2; each move takes
``transfer_s`` seconds on the worker's transition thread. Generate answers a fixed text after
``serve_s`` seconds, holding its activations on the device meanwhile.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from omnistage.worker.v1 import inference_service_pb2, types_pb2
from omnistage_worker.config import WorkerConfig
from omnistage_worker.runners.base import ModelRunner, SleepController

WEIGHTS_ENV = "OMNISTAGE_SIM_WEIGHTS"  # bytes of the simulated model's weights
TRANSFER_ENV = "OMNISTAGE_SIM_TRANSFER_S"  # seconds per weight move (sleep or wake)
SERVE_ENV = "OMNISTAGE_SIM_SERVE_S"  # seconds per request


@dataclass(frozen=True)
class Moved:
    """What one move did (the engine's TransferStats)."""

    bytes_moved: int
    seconds: float
    noop: bool = False


class SimController:
    """Where the simulated weights are: device (level 0), host (1) or nowhere (2)."""

    def __init__(self, weights: int, transfer_s: float) -> None:
        self._weights = weights
        self._transfer_s = transfer_s
        self._level = 2

    @property
    def level(self) -> int:
        return self._level

    @property
    def weights_bytes(self) -> int:
        return self._weights

    def _move(self, to_level: int) -> Moved:
        if to_level == self._level:
            return Moved(0, 0.0, noop=True)
        start = time.monotonic()
        if self._transfer_s > 0:
            time.sleep(self._transfer_s)
        self._level = to_level
        return Moved(self._weights, time.monotonic() - start)

    def activate(self) -> Moved:
        return self._move(0)

    def start_asleep(self, level: int) -> Moved:
        self._level = level
        return Moved(0, 0.0, noop=True)

    def sleep(self, level: int) -> Moved:
        return self._move(level)

    def wake(self) -> Moved:
        return self._move(0)

    def device_bytes(self) -> int:
        return self._weights if self._level == 0 else 0

    def host_bytes(self) -> int:
        return self._weights if self._level == 1 else 0


class SimRunner(ModelRunner):
    """An AR/transformers runner whose model is ``weights`` bytes (see the module docstring)."""

    runner_kind = types_pb2.RUNNER_AR
    backend_kind = types_pb2.BACKEND_TRANSFORMERS

    def __init__(
        self, config: WorkerConfig, weights: int, transfer_s: float = 0.0, serve_s: float = 0.0
    ) -> None:
        super().__init__(config)
        self.weights = weights
        self.transfer_s = transfer_s
        self.serve_s = serve_s

    def load(self) -> None:
        """Nothing to read: the weights are a number."""

    def build_controller(self) -> SleepController:
        return SimController(self.weights, self.transfer_s)

    def _generate(
        self, request: inference_service_pb2.GenerateRequest
    ) -> inference_service_pb2.GenerateResponse:
        if self.serve_s > 0:
            time.sleep(self.serve_s)
        text = inference_service_pb2.TextOutput(token_ids=[1], text="simulated")
        return inference_service_pb2.GenerateResponse(
            request_id=request.request_id, text=text, batch_size=1
        )


class SimDiffusionRunner(SimRunner):
    """The same, reporting itself as a diffusion/diffusers runner."""

    runner_kind = types_pb2.RUNNER_DIFFUSION
    backend_kind = types_pb2.BACKEND_DIFFUSERS


def sim_runner(config: WorkerConfig, env: dict[str, str]) -> SimRunner:
    """The runner for ``config`` (its --runner picks the kind), sized from the pod's env."""
    weights = int(env.get(WEIGHTS_ENV, str(1 << 30)))
    transfer_s = float(env.get(TRANSFER_ENV, "0"))
    serve_s = float(env.get(SERVE_ENV, "0"))
    kind = SimDiffusionRunner if config.runner == "diffusion" else SimRunner
    return kind(config, weights, transfer_s, serve_s)
