"""The worker container's command line for a stage (pure, no network).

Public API (stable):
    ``worker_args(stage, *, initial_state, sleep_level=None, epoch=0) -> list[str]`` (always
    with ``--device``: see ``worker_device(stage) -> "cpu" | "cuda"``)
    ``start_level(stage, initial_state, sleep_level=None) -> int``: the ``--sleep-level`` a
    pod starts with (a VLLM stage started asleep: always 2, pre-warmed).
    ``vllm_args(stage) -> list[str]``: the ``--vllm-*`` worker flags of a VLLM stage.
"""

from __future__ import annotations

from omnistage_operator.api.serving import serving_args
from omnistage_operator.api.spec import Backend, DesiredState, StageSpec, WorkerDevice
from omnistage_operator.api.worker_tls import tls_args
from omnistage_operator.k8s.token_secret import TOKEN_FILE

__all__ = ["start_level", "vllm_args", "worker_args", "worker_device"]


def worker_device(stage: StageSpec) -> str:
    """The worker's ``--device``: the spec's cpu/cuda, else (unset or auto) cuda when the stage
    has GPUs and cpu when ``gpus`` is 0. The worker itself knows no "auto" and defaults to cpu,
    which would silently run a GPU stage on the CPU."""
    device = stage.worker.device
    if device is None or device is WorkerDevice.AUTO:
        return "cuda" if stage.gpus > 0 else "cpu"
    return device.value


def start_level(
    stage: StageSpec, initial_state: DesiredState, sleep_level: int | None = None
) -> int:
    """The level the worker starts with: ``sleep_level``, else the spec's. A VLLM stage started
    asleep is pre-warmed at level 2 whatever the spec says: its worker imports vLLM and starts
    no engine (nothing on the device or host) until its first wake, and refuses any other
    level asleep. After that wake it sleeps at the spec's level."""
    if stage.backend is Backend.VLLM and DesiredState(initial_state) is DesiredState.ASLEEP:
        return 2
    return stage.sleep_level if sleep_level is None else sleep_level


def worker_args(
    stage: StageSpec,
    *,
    initial_state: DesiredState,
    sleep_level: int | None = None,
    epoch: int = 0,
) -> list[str]:
    """The worker's command-line arguments, in the contract's order. ``epoch``: the leadership
    epoch of the operator that makes the pod (``--epoch``; the worker refuses older orders, and
    epoch 0, from its start)."""
    level = start_level(stage, initial_state, sleep_level)
    if level not in (1, 2):
        raise ValueError(f"sleep level must be 1 or 2, got {level}")
    args = [
        "--runner",
        stage.runner.cli,
        "--backend",
        stage.backend.cli,
        "--model",
        stage.model.path,
        "--host=$(POD_IP)",
        "--port",
        str(stage.worker.port),
        "--initial-state",
        DesiredState(initial_state).cli,
        "--sleep-level",
        str(level),
        "--token-file",
        TOKEN_FILE,
    ]
    args += ["--device", worker_device(stage)]
    if stage.gpus > 1:  # the model spans the stage's devices (the first gpus the pod sees)
        args += ["--gpus", str(stage.gpus)]
    if epoch > 0:
        args += ["--epoch", str(epoch)]
    args += ["--drain-timeout", str(stage.drain_timeout_s)]
    args += ["--http-port", str(stage.worker.http_port)]
    args += ["--metrics-port", str(stage.worker.metrics_port)]
    if stage.activation.on_demand:
        args += ["--activation", stage.activation.policy.cli]
        args += ["--hold-timeout", f"{stage.activation.hold_timeout_s:g}"]
    if stage.worker.dtype is not None:
        args += ["--dtype", stage.worker.dtype]
    if stage.backend is Backend.VLLM:
        args += vllm_args(stage)
    args += serving_args(stage.serving)
    args += tls_args(stage.worker.tls)
    args += list(stage.worker.args)
    return args


def vllm_args(stage: StageSpec) -> list[str]:
    """The ``--vllm-*`` flags of a VLLM stage: ``spec.vllm``, tensor parallel size = ``gpus``,
    and, without ``gpuMemoryUtilization``, ``vram.request`` (the worker divides it by the
    device's total memory)."""
    engine = stage.vllm
    args = ["--vllm-tensor-parallel-size", str(max(1, stage.gpus))]
    if engine.max_model_len is not None:
        args += ["--vllm-max-model-len", str(engine.max_model_len)]
    if engine.gpu_memory_utilization is not None:
        args += ["--vllm-gpu-memory-utilization", repr(engine.gpu_memory_utilization)]
    elif stage.vram_request_bytes is not None:
        args += ["--vllm-memory-bytes", str(stage.vram_request_bytes)]
    if engine.enforce_eager:
        args.append("--vllm-enforce-eager")
    if engine.max_num_seqs is not None:
        args += ["--vllm-max-num-seqs", str(engine.max_num_seqs)]
    if engine.kv_cache_dtype is not None:
        args += ["--vllm-kv-cache-dtype", engine.kv_cache_dtype]
    for flag, value in (
        ("enable-prefix-caching", engine.enable_prefix_caching),
        ("enable-chunked-prefill", engine.enable_chunked_prefill),
    ):
        if value is not None:
            args.append(f"--vllm-{flag}" if value else f"--no-vllm-{flag}")
    if engine.enable_auto_tool_choice:
        args.append("--vllm-enable-auto-tool-choice")
    for flag, text in (
        ("tool-call-parser", engine.tool_call_parser),
        ("reasoning-parser", engine.reasoning_parser),
        ("chat-template", engine.chat_template),
    ):
        if text is not None:
            args += [f"--vllm-{flag}", text]
    return args
