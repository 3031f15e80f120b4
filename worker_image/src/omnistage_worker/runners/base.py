"""What every runner provides, and the sleep controller the worker drives."""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Protocol

from omnistage.worker.v1 import inference_service_pb2, types_pb2
from omnistage_worker.config import WorkerConfig

if TYPE_CHECKING:
    import torch

    from omnistage_worker.engine.placement import Block
    from omnistage_worker.memory import MemoryProbe

log = logging.getLogger(__name__)

# Upper bounds on request fields, so a typo cannot occupy a stage for hours.
MAX_NEW_TOKENS = 8192
MAX_STEPS = 1000
MAX_SIDE = 8192

#: Receives the token ids and text generated since its previous call (AR runners).
ChunkSink = Callable[[list[int], str], None]
#: Receives each chunk of AR output as it is generated (ids, text and log probabilities).
TextChunkSink = Callable[[inference_service_pb2.TextChunk], None]


class InvalidRequest(ValueError):
    """A Generate request field the runner cannot accept; ``field`` names it."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field


class Stats(Protocol):
    """What one weight movement reports (the engine's TransferStats)."""

    @property
    def bytes_moved(self) -> int: ...

    @property
    def seconds(self) -> float: ...

    @property
    def noop(self) -> bool: ...


class SleepController(Protocol):
    """Moves the model's weights between the device, host memory and nothing.

    The torch runners use the weight engine; vLLM uses its own sleep mode.
    """

    @property
    def level(self) -> int: ...

    @property
    def weights_bytes(self) -> int: ...

    def activate(self) -> Stats: ...

    def start_asleep(self, level: int) -> Stats: ...

    def sleep(self, level: int) -> Stats: ...

    def wake(self) -> Stats: ...

    def device_bytes(self) -> int: ...

    def host_bytes(self) -> int: ...


def torch_dtype(name: str) -> torch.dtype | None:
    """The torch dtype for ``--dtype`` (None for auto: as saved)."""
    import torch

    return {
        "auto": None,
        "float32": torch.float32,
        "float16": torch.float16,
        "bfloat16": torch.bfloat16,
    }[name]


def validate_common(request: inference_service_pb2.GenerateRequest) -> None:
    """Checks every runner applies: a prompt, and no negative sizes."""
    if not request.prompt and not request.HasField("prompt_embeds"):
        raise InvalidRequest("prompt", "required (must not be empty)")
    for field, value, bound in (
        ("max_new_tokens", request.max_new_tokens, MAX_NEW_TOKENS),
        ("num_inference_steps", request.num_inference_steps, MAX_STEPS),
        ("height", request.height, MAX_SIDE),
        ("width", request.width, MAX_SIDE),
    ):
        if value < 0:
            raise InvalidRequest(field, f"{value} is negative")
        if value > bound:
            raise InvalidRequest(field, f"{value} is above the limit of {bound}")
    if not request.guidance_scale >= 0:  # also refuses NaN
        raise InvalidRequest("guidance_scale", f"{request.guidance_scale} must be >= 0")


class ModelRunner(ABC):
    """One model, loaded from a local directory, served by Generate."""

    runner_kind: ClassVar[types_pb2.Runner.ValueType]
    backend_kind: ClassVar[types_pb2.Backend.ValueType]

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.model_dir = config.model
        # Generate calls run one at a time: pipelines and samplers keep per-call state.
        self._generate_lock = threading.Lock()
        # Where the request being generated streams its chunks (None: not streamed).
        self.chunk_sink: TextChunkSink | None = None
        # The worker's probe, set before :meth:`load` (a runner may measure with it).
        self.probe: MemoryProbe | None = None

    #: Whether a worker asleep at level 1 can drop its host copy (1 -> 2) without waking.
    can_deepen: ClassVar[bool] = True
    #: Whether the worker process creates its own device context before loading (the torch
    #: runners: it is the residual baseline). vLLM's engine runs in its own process tree.
    owns_device_context: ClassVar[bool] = True

    def residual_baseline(self) -> int | None:
        """After :meth:`load`: what this runner holds on the device asleep, measured by the
        runner itself (None: the context measured before loading is the baseline)."""
        return None

    @property
    def supports_level2(self) -> bool:
        """Whether a level-2 sleep can be woken from (the weights can be reloaded)."""
        return True

    @abstractmethod
    def load(self) -> None:
        """Load the model (torch runners: onto the CPU; the controller moves it)."""

    @abstractmethod
    def build_controller(self) -> SleepController:
        """The controller that sleeps and wakes this model (after :meth:`load`)."""

    def validate(self, request: inference_service_pb2.GenerateRequest) -> None:
        """Refuse a bad request with :class:`InvalidRequest` before it is queued."""
        validate_common(request)

    @property
    def max_concurrency(self) -> int:
        """How many requests the worker hands this runner at once (1: one after the other;
        a batching runner takes up to its batch and queues the rest itself)."""
        return 1

    def transient_bytes(self) -> int:
        """Device bytes the runner holds for requests in flight (a batch's KV cache), beside
        the weights; 0 when idle."""
        return 0

    @property
    def wakes_piece_by_piece(self) -> bool:
        """Whether its wake takes device memory piece by piece through the claim gate
        (``engine.claims``): only such a runner wakes under a claim limit, beside another
        stage's sleep (an overlapped hand-over)."""
        return False

    def warm_up(self) -> None:  # noqa: B027 (a runner without a warm-up does nothing)
        """After activation, before the worker reports Active: run what makes the first
        request slow (kernel loading, library handles), so that request does not pay it."""

    def close(self) -> None:  # noqa: B027 (most runners have no threads of their own)
        """End the runner's own threads (after the requests queued to them)."""

    def generate(
        self, request: inference_service_pb2.GenerateRequest, sink: TextChunkSink | None = None
    ) -> inference_service_pb2.GenerateResponse:
        """Run one request (blocking; called from a worker thread); ``sink`` gets AR output
        as it is generated (runners that cannot stream only return the response)."""
        with self._generate_lock:
            self.chunk_sink = sink
            try:
                return self._generate(request)
            finally:
                self.chunk_sink = None

    @abstractmethod
    def _generate(
        self, request: inference_service_pb2.GenerateRequest
    ) -> inference_service_pb2.GenerateResponse: ...


class TorchRunner(ModelRunner):
    """A runner whose weights are torch modules moved by the weight engine."""

    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config)
        import torch

        self.device = torch.device(str(config.device))
        self.dtype = torch_dtype(config.dtype)
        if config.cpu_threads is not None:
            torch.set_num_threads(config.cpu_threads)

    @abstractmethod
    def modules(self) -> Mapping[str, torch.nn.Module]:
        """The named modules that hold the weights."""

    @abstractmethod
    def weight_files(self) -> Mapping[str, Sequence[Path]] | None:
        """Per module name, the safetensors files it reloads from (None: level 2 unsupported)."""

    @property
    def supports_level2(self) -> bool:
        return self.weight_files() is not None

    @property
    def wakes_piece_by_piece(self) -> bool:
        """The weight engine maps each device piece through the claim gate."""
        return True

    def blocks(self) -> list[Block]:
        """The blocks a stage on several devices deals out (default: whole components)."""
        from omnistage_worker.engine.placement import blocks_of

        return blocks_of(self.modules(), whole=True)

    def build_controller(self) -> SleepController:
        from omnistage_worker.engine import WeightEngine

        if self.config.gpus == 1:
            engine: SleepController = WeightEngine(
                self.modules(),
                self.device,
                self.weight_files(),
                host_copy=self.config.sleep_level == 1,
            )
            return engine
        return self._build_sharded()

    def _build_sharded(self) -> SleepController:
        """One process over the stage's devices: a device map, one engine per device, hooks."""
        import torch

        from omnistage_worker.engine import hooks
        from omnistage_worker.engine.placement import execution_map, plan_device_map
        from omnistage_worker.engine.sharded import ShardedEngine

        devices = [torch.device(n) for n in self.config.device.names(self.config.gpus)]
        device_map = plan_device_map(self.blocks(), len(devices))
        sharded = ShardedEngine(
            self.modules(),
            devices,
            device_map,
            self.weight_files(),
            host_copy=self.config.sleep_level == 1,
        )
        hooks.attach(self.modules(), execution_map(sharded.slots, device_map), devices)
        for ordinal, shard in enumerate(sharded.shards):
            log.info("device %d (%s): %d weight bytes", ordinal, shard.device, shard.weights_bytes)
        engine: SleepController = sharded
        return engine

    def resolve_dtype(self, config_dirs: Sequence[Path], files: Sequence[Path]) -> None:
        """Set :attr:`dtype` for loading: ``auto`` becomes the dtype the weights are saved in."""
        from omnistage_worker.runners.dtypes import resolve_dtype

        name = resolve_dtype(self.config.dtype, config_dirs, files)
        self.dtype = torch_dtype(name)


def safetensors_in(directory: Path, variant: str | None = None) -> list[Path]:
    """The safetensors files the loaders read from a directory (index, variant, single file)."""
    from omnistage_worker.runners.weight_files import weight_files_in

    return weight_files_in(directory, variant)
