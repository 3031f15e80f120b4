"""Worker configuration: the validated settings of one worker process.

Pure logic: nothing here imports torch or opens a socket, so the CLI can refuse bad input
in milliseconds. Every refusal is a :class:`ConfigError` that names the flag at fault.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Final

from omnistage_worker.dtype_choices import DTYPES
from omnistage_worker.limits import RequestLimits
from omnistage_worker.quantities import QuantityError, parse_quantity

if TYPE_CHECKING:
    from omnistage_worker.token_review_settings import TokenReviewSettings

MI: Final = 1024 * 1024
DEFAULT_RESIDUAL_SLACK: Final = 128 * MI
DEFAULT_PORT: Final = 50051
DEFAULT_DRAIN_TIMEOUT_S: Final = 600.0
DEFAULT_HTTP_PORT: Final = 8000
DEFAULT_HOLD_TIMEOUT_S: Final = 60.0
DEFAULT_MAX_HELD: Final = 256
DEFAULT_MAX_BATCH: Final = 32
"""Requests a torch stage runs together (AR: rows of the running batch; diffusion: one call)."""
MAX_BATCH: Final = 1024
ACTIVATIONS: Final = ("manual", "ondemand")

RUNNER_BACKENDS: Final[dict[str, tuple[str, ...]]] = {
    "diffusion": ("diffusers",),
    "ar": ("transformers", "vllm"),
}
BACKENDS: Final = ("diffusers", "transformers", "vllm")

_DEVICE = re.compile(r"^(cpu|cuda)(?::(\d+))?$")


class ConfigError(ValueError):
    """A refused setting; ``flag`` names the command-line flag at fault."""

    def __init__(self, flag: str, reason: str) -> None:
        super().__init__(f"{flag}: {reason}")
        self.flag = flag
        self.reason = reason


def parse_byte_flag(text: str, flag: str) -> int:
    """A byte count given to ``flag``: a Kubernetes quantity (:mod:`.quantities`), e.g. ``80Gi``."""
    try:
        return parse_quantity(text)
    except QuantityError as exc:
        raise ConfigError(flag, str(exc)) from exc


MAX_GPUS = 8
"""The most devices one stage spans (the CRD's bound on ``spec.gpus``)."""


@dataclass(frozen=True)
class DeviceSpec:
    """The device a worker runs on: ``cpu`` or ``cuda`` with a torch index."""

    kind: str
    index: int = 0

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    def __str__(self) -> str:
        return f"cuda:{self.index}" if self.is_cuda else "cpu"

    def names(self, gpus: int) -> list[str]:
        """The torch devices of a stage on ``gpus`` devices: ``cuda:i..i+gpus-1``; on a CPU,
        ``cpu`` once per simulated device."""
        if self.is_cuda:
            return [f"cuda:{self.index + i}" for i in range(gpus)]
        return ["cpu"] * gpus


def parse_device(text: str) -> DeviceSpec:
    """Parse ``cpu``, ``cuda`` or ``cuda:N``."""
    match = _DEVICE.match(text.strip())
    if match is None:
        raise ConfigError("--device", f"{text!r} is not a device (use cpu, cuda or cuda:N)")
    kind, index = match.group(1), match.group(2)
    if kind == "cpu" and index not in (None, "0"):
        raise ConfigError("--device", f"{text!r}: the cpu device has no index")
    return DeviceSpec(kind=kind, index=int(index) if index is not None else 0)


@dataclass(frozen=True)
class Identity:
    """Who this worker is, as written into every Ack."""

    stage: str = ""
    namespace: str = ""
    pod: str = ""
    rank: int = 0
    node: str = ""
    pid: int = field(default_factory=os.getpid)


# vLLM 0.24's ``--kv-cache-dtype`` choices that run on the GPUs stages use.
KV_CACHE_DTYPES: Final = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
MAX_NUM_SEQS: Final = 65536


@dataclass(frozen=True)
class VllmArgs:
    """vLLM engine arguments (``--vllm-*`` flags; the operator writes them from ``spec.vllm``).

    ``gpu_memory_utilization``: vLLM's per-instance share of each device's total memory. When
    not given it is derived at start: ``memory_bytes`` (the stage's ``vram.request``, a sum over
    its devices) divided by the tensor parallel size and by the device's total memory; without
    either, the device's measured free memory at start (less 2%) over its total.
    """

    max_model_len: int | None = None
    gpu_memory_utilization: float | None = None
    memory_bytes: int | None = None
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    attention_backend: str | None = None
    max_num_seqs: int | None = None
    kv_cache_dtype: str | None = None
    enable_prefix_caching: bool | None = None
    enable_chunked_prefill: bool | None = None
    # Chat serving (vLLM's frontend options): tool calls, reasoning, a chat template file.
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    chat_template: Path | None = None
    # Sleep and wake through the worker's extension (runners/vllm_wake_cuda): host copy kept,
    # copies issued at once on one stream, the KV cache mapped while they run.
    fast_wake: bool = True

    def utilization(self, total: int, free: int) -> float:
        """The ``gpu_memory_utilization`` for a device of ``total`` bytes, ``free`` now.

        Raises :class:`ConfigError` when the stage's memory does not fit the device now.
        """
        if total <= 0:
            raise ConfigError("--device", "the device reports no memory")
        if self.gpu_memory_utilization is not None:
            share = self.gpu_memory_utilization
            flag = "--vllm-gpu-memory-utilization"
        elif self.memory_bytes is not None:
            share = self.memory_bytes / self.tensor_parallel_size / total
            flag = "--vllm-memory-bytes"
        else:
            return max(0.01, int((free / total - 0.02) * 100) / 100)
        if share > 1.0:
            raise ConfigError(flag, f"{share:.3f} of the device's {total} bytes is more than all")
        if share * total > free:
            raise ConfigError(
                flag,
                f"needs {int(share * total)} bytes per device and only {free} are free now "
                "(vLLM takes its memory while it starts)",
            )
        return share


@dataclass(frozen=True)
class WorkerConfig:
    """Validated settings of one worker process."""

    runner: str
    backend: str
    model: Path
    host: str = "0.0.0.0"
    port: int = DEFAULT_PORT
    device: DeviceSpec = field(default_factory=lambda: DeviceSpec("cpu"))
    initial_state: str = "active"
    sleep_level: int = 1
    token: str | None = None
    # Kubernetes-issued tokens instead (TokenReview; see token_review.py); None: off.
    token_review: TokenReviewSettings | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    # Plaintext gRPC health only (for the kubelet's probes, which cannot speak TLS; None: off).
    health_port: int | None = None
    residual_slack: int = DEFAULT_RESIDUAL_SLACK
    identity: Identity = field(default_factory=Identity)
    dtype: str = "auto"
    variant: str | None = None
    components: tuple[str, ...] = ()
    sequential: bool = False
    shutdown_grace_s: float = 30.0
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    ack_cache_size: int = 1024
    cpu_threads: int | None = None
    termination_log: Path | None = None
    gpus: int = 1
    """How many devices the stage's model spans (one process; see engine.placement)."""
    vllm: VllmArgs = field(default_factory=VllmArgs)
    # OpenAI-compatible HTTP beside gRPC (None: off; 0: any free port).
    http_port: int | None = None
    # The name clients give as the OpenAI "model" ("": the stage name, else the model dir's).
    served_model_name: str = ""
    # manual: a request to a sleeping worker is refused; ondemand: held until it is awake.
    activation: str = "manual"
    hold_timeout_s: float = DEFAULT_HOLD_TIMEOUT_S
    max_held: int = DEFAULT_MAX_HELD
    # How many requests a torch runner runs together (one batch).
    max_batch: int = DEFAULT_MAX_BATCH
    # AR on one CUDA device: replay plain decode steps as CUDA graphs (runners/step_graphs.py).
    decode_graphs: bool = True
    # Bounds on one request (spec.limits) and the HTTP API's bearer token (spec.http).
    limits: RequestLimits = field(default_factory=RequestLimits)
    http_token: str | None = None
    # The leadership epoch the worker starts having obeyed (``--epoch``; 0: none).
    epoch: int = 0
    # Prometheus /metrics beside gRPC (None: off; 0: any free port).
    metrics_port: int | None = None

    @property
    def model_name(self) -> str:
        """The name this worker serves under (OpenAI ``model``)."""
        return self.served_model_name or self.identity.stage or self.model.name

    def __post_init__(self) -> None:
        validate(self)


def validate(config: WorkerConfig) -> None:
    """Refuse an inconsistent configuration with a :class:`ConfigError` naming the flag."""
    _check_model(config)
    _check_serving(config)
    if config.residual_slack < 0:
        raise ConfigError("--residual-slack", "must not be negative")
    if config.dtype not in DTYPES:
        raise ConfigError("--dtype", f"{config.dtype!r} (one of {', '.join(DTYPES)})")
    if config.backend == "vllm":
        _check_vllm(config)
    elif config.vllm != VllmArgs():
        raise ConfigError(
            "--vllm-*", f"vLLM engine flags need --backend vllm, not {config.backend}"
        )
    _check_components(config)
    _check_limits(config)


def _check_model(config: WorkerConfig) -> None:
    """Runner, backend and the model directory."""
    if config.runner not in RUNNER_BACKENDS:
        raise ConfigError("--runner", f"unknown runner {config.runner!r} (diffusion or ar)")
    if config.backend not in BACKENDS:
        raise ConfigError("--backend", f"unknown backend {config.backend!r}")
    allowed = RUNNER_BACKENDS[config.runner]
    if config.backend not in allowed:
        raise ConfigError(
            "--backend",
            f"runner {config.runner!r} cannot use backend {config.backend!r} "
            f"(it needs {' or '.join(allowed)})",
        )
    if not config.model.exists():
        raise ConfigError("--model", f"model directory {str(config.model)!r} does not exist")
    if not config.model.is_dir():
        raise ConfigError("--model", f"{str(config.model)!r} is not a directory")


def _check_serving(config: WorkerConfig) -> None:
    """Port, initial state and level, token and TLS files."""
    if not 0 <= config.port <= 65535:
        raise ConfigError("--port", f"{config.port} is not a TCP port (0-65535)")
    metrics = config.metrics_port
    if metrics is not None and not 0 <= metrics <= 65535:
        raise ConfigError("--metrics-port", f"{metrics} is not a TCP port (0-65535)")
    if metrics and metrics in (config.port, config.http_port):
        raise ConfigError("--metrics-port", f"{metrics} is already the gRPC or HTTP port")
    if config.initial_state not in ("active", "asleep"):
        raise ConfigError("--initial-state", f"{config.initial_state!r} (active or asleep)")
    if config.sleep_level not in (1, 2):
        raise ConfigError("--sleep-level", f"{config.sleep_level} (1 or 2)")
    if config.token is not None and not config.token:
        raise ConfigError("--token-file", "the token file is empty")
    if config.token is not None and config.token_review is not None:
        raise ConfigError("--token-file", "give a shared token or --operator-identity, not both")
    if (config.tls_cert is None) != (config.tls_key is None):
        raise ConfigError("--tls-cert/--tls-key", "give both the certificate and the key, or none")
    for flag, path in (("--tls-cert", config.tls_cert), ("--tls-key", config.tls_key)):
        if path is not None and not path.is_file():
            raise ConfigError(flag, f"{str(path)!r} is not a readable file")
    health = config.health_port
    if health is not None and not 0 <= health <= 65535:
        raise ConfigError("--health-port", f"{health} is not a TCP port (0-65535)")
    if health and health in (config.port, config.http_port):
        raise ConfigError("--health-port", "must differ from --port and --http-port")


def _check_vllm(config: WorkerConfig) -> None:
    """vLLM takes its GPUs from CUDA_VISIBLE_DEVICES and device memory while it loads."""
    if not config.device.is_cuda:
        raise ConfigError("--device", "the vllm backend needs a CUDA device")
    if config.device.index != 0:
        raise ConfigError(
            "--device",
            "with --backend vllm use cuda (vLLM takes its GPUs from CUDA_VISIBLE_DEVICES)",
        )
    if config.initial_state == "asleep" and config.sleep_level != 2:
        raise ConfigError(
            "--sleep-level",
            f"{config.sleep_level} with --initial-state asleep and --backend vllm: such a stage "
            "starts pre-warmed at level 2 (vLLM imported, nothing on the device or host; its "
            "engine starts at the first wake), give --sleep-level 2",
        )
    if config.vllm.tensor_parallel_size != config.gpus:
        raise ConfigError(
            "--vllm-tensor-parallel-size",
            f"{config.vllm.tensor_parallel_size} differs from --gpus {config.gpus} "
            "(vLLM shards the model over all of the stage's GPUs)",
        )
    _check_vllm_args(config.vllm)


def _check_vllm_args(args: VllmArgs) -> None:
    """Engine arguments vLLM would refuse only after minutes of loading."""
    util = args.gpu_memory_utilization
    if util is not None and not 0.0 < util <= 1.0:  # also refuses NaN
        raise ConfigError("--vllm-gpu-memory-utilization", f"{util} (in (0, 1])")
    if util is not None and args.memory_bytes is not None:
        raise ConfigError(
            "--vllm-memory-bytes", "give --vllm-gpu-memory-utilization or this, not both"
        )
    if args.memory_bytes is not None and args.memory_bytes <= 0:
        raise ConfigError("--vllm-memory-bytes", "must be greater than zero")
    if args.max_model_len is not None and args.max_model_len < 1:
        raise ConfigError("--vllm-max-model-len", f"{args.max_model_len} (at least 1)")
    if not 1 <= args.tensor_parallel_size <= 8:
        raise ConfigError("--vllm-tensor-parallel-size", f"{args.tensor_parallel_size} (1 to 8)")
    if args.max_num_seqs is not None and not 1 <= args.max_num_seqs <= MAX_NUM_SEQS:
        raise ConfigError("--vllm-max-num-seqs", f"{args.max_num_seqs} (1 to {MAX_NUM_SEQS})")
    dtype = args.kv_cache_dtype
    if dtype is not None and dtype not in KV_CACHE_DTYPES:
        raise ConfigError(
            "--vllm-kv-cache-dtype", f"{dtype!r} (one of {', '.join(KV_CACHE_DTYPES)})"
        )
    backend = args.attention_backend
    if backend is not None and not re.fullmatch(r"[A-Z][A-Z0-9_]{0,63}", backend):
        raise ConfigError(
            "--vllm-attention-backend", f"{backend!r} is not a backend name (e.g. TRITON_ATTN)"
        )
    _check_chat_args(args)


def _check_chat_args(args: VllmArgs) -> None:
    """Tool and reasoning parsers are names; the chat template is a readable file."""
    for flag, name in (
        ("--vllm-tool-call-parser", args.tool_call_parser),
        ("--vllm-reasoning-parser", args.reasoning_parser),
    ):
        if name is not None and not _PARSER.fullmatch(name):
            raise ConfigError(flag, f"{name!r} is not a parser name (e.g. hermes, deepseek_r1)")
    if args.enable_auto_tool_choice != (args.tool_call_parser is not None):
        raise ConfigError(
            "--vllm-tool-call-parser",
            "give it exactly with --vllm-enable-auto-tool-choice (vLLM uses the parser only "
            "for automatic tool choice, and automatic tool choice needs it)",
        )
    template = args.chat_template
    if template is not None and not (template.is_absolute() and template.is_file()):
        raise ConfigError("--vllm-chat-template", f"{template} is not a file (an absolute path)")


_PARSER = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")


_VARIANT = re.compile(r"^[A-Za-z0-9_]+$")
_COMPONENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def _check_components(config: WorkerConfig) -> None:
    """Variant name, declared components and sequential mode."""
    if config.variant is not None and not _VARIANT.match(config.variant):
        raise ConfigError("--variant", f"{config.variant!r} is not a variant name (e.g. fp16)")
    for name in config.components:
        if not _COMPONENT.match(name):
            raise ConfigError("--components", f"{name!r} is not an attribute path")
    if len(set(config.components)) != len(config.components):
        raise ConfigError("--components", "a component is named twice")
    if config.sequential and config.runner != "diffusion":
        raise ConfigError("--sequential", "only diffusion pipelines run sequentially")


def _check_limits(config: WorkerConfig) -> None:
    """Numbers that must not be negative (or zero)."""
    if config.identity.rank < 0:
        raise ConfigError("--rank", "must not be negative")
    if config.shutdown_grace_s < 0:
        raise ConfigError("--shutdown-grace", "must not be negative")
    if not config.drain_timeout_s >= 0:  # also refuses NaN
        raise ConfigError("--drain-timeout", "must not be negative")
    if config.cpu_threads is not None and config.cpu_threads < 1:
        raise ConfigError("--cpu-threads", "must be at least 1")
    if config.epoch < 0:
        raise ConfigError("--epoch", "must not be negative")
    if config.ack_cache_size < 1:
        raise ConfigError("--ack-cache-size", "must be at least 1")
    if not 1 <= config.gpus <= MAX_GPUS:
        raise ConfigError("--gpus", f"{config.gpus} (1 to {MAX_GPUS})")
    if not 1 <= config.max_batch <= MAX_BATCH:
        raise ConfigError("--max-batch", f"{config.max_batch} (1 to {MAX_BATCH})")
    _check_demand(config)


def _check_demand(config: WorkerConfig) -> None:
    """Activation policy, hold bounds and the HTTP port."""
    if config.activation not in ACTIVATIONS:
        raise ConfigError("--activation", f"{config.activation!r} (manual or ondemand)")
    if not config.hold_timeout_s > 0:  # also refuses NaN
        raise ConfigError("--hold-timeout", "must be more than 0 seconds")
    if config.max_held < 1:
        raise ConfigError("--max-held", "must be at least 1")
    if config.http_port is not None and not 0 <= config.http_port <= 65535:
        raise ConfigError("--http-port", f"{config.http_port} is not a TCP port (0-65535)")
    if config.http_port is not None and config.http_port and config.http_port == config.port:
        raise ConfigError("--http-port", "must differ from --port (gRPC)")
    if config.http_token is not None and not config.http_token:
        raise ConfigError("--http-token-file", "the token file is empty")
    bad = config.limits.invalid()
    if bad is not None:
        raise ConfigError(*bad)


def read_token(path: Path, flag: str = "--token-file") -> str:
    """Read a bearer token from a file (surrounding whitespace dropped)."""
    if not path.is_file():
        raise ConfigError(flag, f"{str(path)!r} does not exist or is not a file")
    try:
        token = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(flag, f"cannot read {str(path)!r}: {exc}") from exc
    if not token:
        raise ConfigError(flag, f"{str(path)!r} is empty")
    return token
