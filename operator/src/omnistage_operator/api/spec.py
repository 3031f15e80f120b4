"""The OmniStage spec as typed Python values (pure logic, no kopf, no network).

The CRD (crds/omnistages.omnistage.io.yaml) is the validator: its structural schema and CEL
rules refuse a bad manifest at the API server with a clear message (enums, bounds, name
patterns, reserved names, cross-field rules; tests/e2e/test_crd_validation.py asserts each).
:mod:`omnistage_operator.api.spec_parse` reads a stored body into these types
(``parse_stage``).

Public API (stable):

Enums (``StrEnum``; values are exactly the CRD's):
    ``Runner`` (``DIFFUSION="Diffusion"``, ``AR="AR"``; ``.cli`` -> ``"diffusion"|"ar"``)
    ``Backend`` (``DIFFUSERS``, ``TRANSFORMERS``, ``VLLM``; ``.cli`` -> lower-case worker flag)
    ``DesiredState`` (``ACTIVE="Active"``, ``ASLEEP="Asleep"``; ``.cli`` -> ``"active"|"asleep"``)
    ``PlacementMode`` (``DRA``, ``EXPLICIT="Explicit"``)
    ``WorkerDevice`` (``AUTO="auto"``, ``CPU="cpu"``, ``CUDA="cuda"``)
Constants: ``GROUP="omnistage.io"``, ``VERSION="v1alpha1"``, ``API_VERSION``, ``KIND="OmniStage"``,
    ``PLURAL="omnistages"``, defaults ``DEFAULT_*``, bounds ``MIN_/MAX_PRIORITY``, ``MAX_GPUS``,
    ``MIN_/MAX_PORT``, ``MIN_/MAX_DRAIN_TIMEOUT_S``, ``MAX_STAGE_NAME_LENGTH``; ``DTYPES``;
    ``BACKENDS_FOR_RUNNER``; names the operator owns: ``RESERVED_ENV``, ``RESERVED_ARGS``,
    ``RESERVED_VOLUMES``, ``TOKEN_MOUNT_DIR``.
Dataclasses (frozen; mapping-valued fields are excluded from hashing):
    ``ModelSpec(path, mount_path, volume, source)`` (``source``:
    :mod:`omnistage_operator.api.model_source`), ``Colocation(group, priority)``,
    ``Placement(mode, node_name, devices)``, ``WorkerSettings(port, device, args, dtype,
    http_port, tls)`` (``tls``: :mod:`omnistage_operator.api.worker_tls`),
    ``VllmSettings(max_model_len, gpu_memory_utilization, enforce_eager, max_num_seqs,
    kv_cache_dtype, enable_prefix_caching, enable_chunked_prefill, tensor_parallel_size,
    enable_auto_tool_choice, tool_call_parser, reasoning_parser, chat_template)``
    (``spec.vllm``),
    ``TemplateOverrides(resources, env, volumes, volume_mounts, node_selector, tolerations,
    annotations, labels, service_account_name, priority_class_name, extras)`` (``extras``:
    the fields of :mod:`omnistage_operator.api.pod_template`),
    ``StageSpec(name, namespace, uid, generation, runner, backend, model, image, state,
    sleep_level, colocation, gpus, vram_request, vram_request_bytes, placement, worker,
    template, drain_timeout_s, vllm, asleep_components)`` with properties ``group``,
    ``priority``, ``key``
    (``"ns/name"``), ``wants_active``.
Errors:
    ``SpecError(field: str, message: str)`` (``ValueError``; ``str()`` is ``"field: message"``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from omnistage_operator.api.activation import Activation
from omnistage_operator.api.model_source import ModelSource
from omnistage_operator.api.pod_template import SHM_VOLUME, PodExtras
from omnistage_operator.api.serving import HTTP_TOKEN_VOLUME, SERVING_ARGS, Serving
from omnistage_operator.api.worker_tls import TLS_ARGS, TLS_VOLUME, WorkerTls
from omnistage_worker.dtype_choices import DTYPES

__all__ = [
    "API_VERSION",
    "BACKENDS_FOR_RUNNER",
    "DEFAULT_DRAIN_TIMEOUT_S",
    "DEFAULT_GPUS",
    "DEFAULT_MOUNT_PATH",
    "DEFAULT_PORT",
    "DEFAULT_PRIORITY",
    "DEFAULT_SLEEP_LEVEL",
    "DTYPES",
    "GROUP",
    "KIND",
    "MAX_DRAIN_TIMEOUT_S",
    "MAX_GPUS",
    "MAX_PORT",
    "MAX_PRIORITY",
    "MAX_STAGE_NAME_LENGTH",
    "MIN_DRAIN_TIMEOUT_S",
    "MIN_PORT",
    "MIN_PRIORITY",
    "PLURAL",
    "RESERVED_ARGS",
    "RESERVED_ARG_PREFIXES",
    "RESERVED_ENV",
    "RESERVED_VOLUMES",
    "TOKEN_MOUNT_DIR",
    "VERSION",
    "Backend",
    "Colocation",
    "DesiredState",
    "ModelSpec",
    "Placement",
    "PlacementMode",
    "Runner",
    "SpecError",
    "StageSpec",
    "TemplateOverrides",
    "WorkerDevice",
    "WorkerSettings",
]

GROUP = "omnistage.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "OmniStage"
PLURAL = "omnistages"

DEFAULT_MOUNT_PATH = "/models"
DEFAULT_SLEEP_LEVEL = 1
DEFAULT_PRIORITY = 0
DEFAULT_GPUS = 1
DEFAULT_PORT = 50051
DEFAULT_HTTP_PORT = 8000
DEFAULT_METRICS_PORT = 9464
DEFAULT_DRAIN_TIMEOUT_S = 600
MIN_DRAIN_TIMEOUT_S, MAX_DRAIN_TIMEOUT_S = 1, 86400
MIN_PRIORITY, MAX_PRIORITY = -1000, 1000
MAX_GPUS = 8
MIN_PORT, MAX_PORT = 1024, 65535
# "<stage>-worker" names a Service, which must be a DNS-1035 label of at most 63 characters.
MAX_STAGE_NAME_LENGTH = 56

# Environment variables and worker flags the operator sets itself (or that would let a pod
# bypass the memory gate); overrides may not touch them. The CRD refuses each flag, any prefix
# of it (argparse would take "--gpu" for "--gpus"; the worker refuses abbreviations too) and
# every flag starting with one of RESERVED_ARG_PREFIXES, in spec.worker.args.
RESERVED_ENV = frozenset(
    {
        "POD_IP",
        "POD_NAME",
        "POD_NAMESPACE",
        "NODE_NAME",
        "OMNISTAGE_STAGE",
        "NVIDIA_VISIBLE_DEVICES",
        "CUDA_VISIBLE_DEVICES",
        "OMNISTAGE_GPUS",
        "OMNISTAGE_RANK",
        "OMNISTAGE_DRAIN_TIMEOUT",
        "OMNISTAGE_MEMORY_PROBE",
        "OMNISTAGE_FAKE_GPU",
        "OMNISTAGE_RESIDUAL_SLACK",
        "OMNISTAGE_MAX_BATCH",
    }
)
RESERVED_ARGS = frozenset(
    {
        "--runner",
        "--backend",
        "--model",
        "--host",
        "--port",
        "--initial-state",
        "--sleep-level",
        "--token-file",
        "--device",
        "--gpus",
        "--dtype",
        "--drain-timeout",
        "--activation",
        "--hold-timeout",
        "--http-port",
        "--metrics-port",
        "--residual-slack",
        "--epoch",
        "--stage",
        "--pod",
        "--namespace",
        "--node",
        "--rank",
    }
)
# spec.limits and spec.http set these (omnistage_operator.api.serving).
RESERVED_ARGS |= SERVING_ARGS
# spec.worker.tls sets these (omnistage_operator.api.worker_tls).
RESERVED_ARGS |= TLS_ARGS
RESERVED_ARG_PREFIXES = frozenset({"--vllm-", "--no-vllm-"})
# Names the builders use for their own volumes and mount points.
RESERVED_VOLUMES = frozenset(
    {"omnistage-token", "model", HTTP_TOKEN_VOLUME, SHM_VOLUME, TLS_VOLUME}
)
TOKEN_MOUNT_DIR = "/var/run/secrets/omnistage"


class Runner(StrEnum):
    """``spec.runner``: which kind of model the stage serves."""

    DIFFUSION = "Diffusion"
    AR = "AR"

    @property
    def cli(self) -> str:
        """The worker's ``--runner`` value."""
        return self.value.lower()


class Backend(StrEnum):
    """``spec.backend``: the library that runs the model."""

    DIFFUSERS = "Diffusers"
    TRANSFORMERS = "Transformers"
    VLLM = "VLLM"

    @property
    def cli(self) -> str:
        """The worker's ``--backend`` value."""
        return self.value.lower()


class DesiredState(StrEnum):
    """``spec.state``: what the user wants the stage to be."""

    ACTIVE = "Active"
    ASLEEP = "Asleep"

    @property
    def cli(self) -> str:
        """The worker's ``--initial-state`` value."""
        return self.value.lower()


class PlacementMode(StrEnum):
    """``spec.placement.mode``: a shared DRA claim per group, or an explicit node and devices."""

    DRA = "DRA"
    EXPLICIT = "Explicit"


class WorkerDevice(StrEnum):
    """``spec.worker.device``: the torch device the worker uses."""

    AUTO = "auto"
    CPU = "cpu"
    CUDA = "cuda"


BACKENDS_FOR_RUNNER: Mapping[Runner, frozenset[Backend]] = {
    Runner.DIFFUSION: frozenset({Backend.DIFFUSERS}),
    Runner.AR: frozenset({Backend.TRANSFORMERS, Backend.VLLM}),
}


class SpecError(ValueError):
    """A stage body is invalid; ``field`` is the dotted path of the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class ModelSpec:
    """``spec.model``: the model directory inside the pod and the volume that holds it."""

    path: str
    mount_path: str = DEFAULT_MOUNT_PATH
    volume: Mapping[str, Any] | None = field(default=None, hash=False)
    # spec.model.source: fetched into the volume by an init container (model_source.py).
    source: ModelSource | None = None


@dataclass(frozen=True)
class Colocation:
    """``spec.colocation``: the group sharing GPUs, and this stage's priority in it."""

    group: str
    priority: int = DEFAULT_PRIORITY


@dataclass(frozen=True)
class Placement:
    """``spec.placement``: DRA (default) or an explicit node and device list."""

    mode: PlacementMode = PlacementMode.DRA
    node_name: str | None = None
    devices: tuple[str, ...] = ()


@dataclass(frozen=True)
class WorkerSettings:
    """``spec.worker``: port and extra flags of the worker process."""

    port: int = DEFAULT_PORT
    device: WorkerDevice | None = None
    args: tuple[str, ...] = ()
    dtype: str | None = None
    http_port: int = DEFAULT_HTTP_PORT  # the OpenAI-compatible HTTP API
    tls: WorkerTls = field(default_factory=WorkerTls)  # spec.worker.tls, spec.worker.healthPort
    metrics_port: int = DEFAULT_METRICS_PORT  # Prometheus /metrics


@dataclass(frozen=True)
class VllmSettings:
    """``spec.vllm``: engine arguments of a VLLM stage (tensor parallel size is ``gpus``).

    ``gpu_memory_utilization`` None: the worker derives it from ``vram.request`` over the
    device's total memory (or, without a request, from the free memory at its start).
    """

    max_model_len: int | None = None
    gpu_memory_utilization: float | None = None
    enforce_eager: bool = False
    max_num_seqs: int | None = None
    kv_cache_dtype: str | None = None
    enable_prefix_caching: bool | None = None
    enable_chunked_prefill: bool | None = None
    tensor_parallel_size: int | None = None  # when given, equal to spec.gpus (the CRD's rule)
    # Chat serving: tool calls, reasoning, the chat template (a path in the pod).
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    chat_template: str | None = None


@dataclass(frozen=True)
class TemplateOverrides:
    """``spec.template``: core pod fields merged into the worker pod (copies of the body)."""

    resources: Mapping[str, Any] | None = field(default=None, hash=False)
    env: tuple[Mapping[str, Any], ...] = field(default=(), hash=False)
    volumes: tuple[Mapping[str, Any], ...] = field(default=(), hash=False)
    volume_mounts: tuple[Mapping[str, Any], ...] = field(default=(), hash=False)
    node_selector: Mapping[str, str] = field(default_factory=dict, hash=False)
    tolerations: tuple[Mapping[str, Any], ...] = field(default=(), hash=False)
    annotations: Mapping[str, str] = field(default_factory=dict, hash=False)
    labels: Mapping[str, str] = field(default_factory=dict, hash=False)
    service_account_name: str | None = None
    priority_class_name: str | None = None
    # securityContext, imagePullSecrets, affinity, ... (omnistage_operator.api.pod_template)
    extras: PodExtras = field(default_factory=PodExtras)


@dataclass(frozen=True)
class StageSpec:
    """One OmniStage, parsed: identity from metadata plus the typed spec with defaults applied."""

    name: str
    namespace: str
    uid: str
    generation: int
    runner: Runner
    backend: Backend
    model: ModelSpec
    image: str
    state: DesiredState = DesiredState.ACTIVE
    sleep_level: int = DEFAULT_SLEEP_LEVEL
    colocation: Colocation = field(default_factory=lambda: Colocation(group="default"))
    gpus: int = DEFAULT_GPUS
    vram_request: str | None = None
    vram_request_bytes: int | None = None
    placement: Placement = field(default_factory=Placement)
    worker: WorkerSettings = field(default_factory=WorkerSettings)
    template: TemplateOverrides = field(default_factory=TemplateOverrides)
    # How long a sleep waits for in-flight requests; the worker (--drain-timeout) and every
    # Sleep the operator sends (SleepRequest.drain_timeout, and its deadline) honour this one value.
    drain_timeout_s: int = DEFAULT_DRAIN_TIMEOUT_S
    # Pipeline components kept asleep while Active (a diffusion stage's encoders, say).
    asleep_components: tuple[str, ...] = ()
    vllm: VllmSettings = field(default_factory=VllmSettings)
    # spec.activation: Manual (spec.state only) or OnDemand (requests wake the stage).
    activation: Activation = field(default_factory=Activation)
    # spec.limits and spec.http: bounds on one request, the HTTP API's bearer token Secret.
    serving: Serving = field(default_factory=Serving)

    @property
    def group(self) -> str:
        """The colocation group name."""
        return self.colocation.group

    @property
    def priority(self) -> int:
        """The colocation priority (higher is admitted first)."""
        return self.colocation.priority

    @property
    def key(self) -> str:
        """``"namespace/name"``, unique in the cluster."""
        return f"{self.namespace}/{self.name}"

    @property
    def wants_active(self) -> bool:
        """Whether the user asked for the stage to hold memory and serve."""
        return self.state is DesiredState.ACTIVE
