"""The OmniStage spec as typed, validated Python values (pure logic, no kopf, no network).

The CRD (crds/omnistages.omnistage.io.yaml) is the validator: its structural schema and CEL
rules refuse a bad manifest at the API server with a clear message (enums, bounds, name
patterns, reserved names, cross-field rules; tests/e2e/test_crd_validation.py asserts each).
``parse_stage`` only reads a stored body into typed values with the CRD's defaults, raising
``SpecError(field, message)`` (a dotted path, ``spec.colocation.group``) when the body cannot
be read at all (a missing required field, a value of the wrong type or outside an enum), and
keeps the rules the CRD does not state: a model volume carries no name, and no extra mount
shadows the worker token.

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
    :mod:`omnistage_operator.model_source`), ``Colocation(group, priority)``,
    ``Placement(mode, node_name, devices)``, ``WorkerSettings(port, device, args, dtype,
    http_port, tls)`` (``tls``: :mod:`omnistage_operator.worker_tls`),
    ``VllmSettings(max_model_len, gpu_memory_utilization, enforce_eager, max_num_seqs,
    kv_cache_dtype, enable_prefix_caching, enable_chunked_prefill, tensor_parallel_size,
    enable_auto_tool_choice, tool_call_parser, reasoning_parser, chat_template)``
    (``spec.vllm``),
    ``TemplateOverrides(resources, env, volumes, volume_mounts, node_selector, tolerations,
    annotations, labels, service_account_name, priority_class_name, extras)`` (``extras``:
    the fields of :mod:`omnistage_operator.pod_template`),
    ``StageSpec(name, namespace, uid, generation, runner, backend, model, image, state,
    sleep_level, colocation, gpus, vram_request, vram_request_bytes, placement, worker,
    template, drain_timeout_s, vllm, asleep_components)`` with properties ``group``,
    ``priority``, ``key``
    (``"ns/name"``), ``wants_active``.
Functions:
    ``parse_stage(body: Mapping[str, Any]) -> StageSpec`` (raises ``SpecError``)
Errors:
    ``SpecError(field: str, message: str)`` (``ValueError``; ``str()`` is ``"field: message"``).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, TypeVar

from omnistage_operator.activation import Activation, ActivationError, parse_activation
from omnistage_operator.model_source import ModelSource, ModelSourceError, parse_model_source
from omnistage_operator.pod_template import (
    SHM_VOLUME,
    PodExtras,
    PodTemplateError,
    parse_pod_extras,
)
from omnistage_operator.quantities import QuantityError, parse_quantity
from omnistage_operator.serving import (
    HTTP_TOKEN_VOLUME,
    SERVING_ARGS,
    Serving,
    ServingError,
    parse_serving,
)
from omnistage_operator.worker_tls import (
    TLS_ARGS,
    TLS_VOLUME,
    WorkerTls,
    WorkerTlsError,
    parse_worker_tls,
)
from omnistage_worker.config import DTYPES

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
    "parse_stage",
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
# spec.limits and spec.http set these (omnistage_operator.serving).
RESERVED_ARGS |= SERVING_ARGS
# spec.worker.tls sets these (omnistage_operator.worker_tls).
RESERVED_ARGS |= TLS_ARGS
RESERVED_ARG_PREFIXES = frozenset({"--vllm-", "--no-vllm-"})
# Names the builders use for their own volumes and mount points.
RESERVED_VOLUMES = frozenset(
    {"omnistage-token", "model", HTTP_TOKEN_VOLUME, SHM_VOLUME, TLS_VOLUME}
)
TOKEN_MOUNT_DIR = "/var/run/secrets/omnistage"

_E = TypeVar("_E", bound=StrEnum)


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
    # securityContext, imagePullSecrets, affinity, ... (omnistage_operator.pod_template)
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


# ---------------------------------------------------------------------------------------------
# Parsing helpers: each takes the dotted path of the value it reads, for the error message.


def _mapping(value: Any, path: str, *, required: bool = False) -> Mapping[str, Any]:
    if value is None:
        if required:
            raise SpecError(path, "is required")
        return {}
    if not isinstance(value, Mapping):
        raise SpecError(path, f"must be an object, got {type(value).__name__}")
    return value


def _string(value: Any, path: str, *, required: bool = False) -> str | None:
    if value is None or value == "":
        if required:
            raise SpecError(path, "is required")
        return None
    if not isinstance(value, str):
        raise SpecError(path, f"must be a string, got {type(value).__name__}")
    return value


def _int(value: Any, path: str, default: int) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(path, f"must be an integer, got {value!r}")
    return value


def _enum(enum: type[_E], value: Any, path: str, default: _E | None = None) -> _E:
    if value is None:
        if default is None:
            raise SpecError(path, f"is required (one of {', '.join(m.value for m in enum)})")
        return default
    try:
        return enum(value)
    except ValueError:
        allowed = ", ".join(m.value for m in enum)
        raise SpecError(path, f"must be one of {allowed}, got {value!r}") from None


def _list_of_objects(value: Any, path: str) -> tuple[Mapping[str, Any], ...]:
    if value is None:
        return ()
    if not isinstance(value, Sequence) or isinstance(value, str):
        raise SpecError(path, "must be a list")
    items: list[Mapping[str, Any]] = []
    for i, item in enumerate(value):
        if not isinstance(item, Mapping):
            raise SpecError(f"{path}[{i}]", "must be an object")
        items.append(copy.deepcopy(dict(item)))
    return tuple(items)


def _string_map(value: Any, path: str) -> dict[str, str]:
    mapping = _mapping(value, path)
    out: dict[str, str] = {}
    for k, v in mapping.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise SpecError(f"{path}.{k}", "keys and values must be strings")
        out[k] = v
    return out


def _strings(value: Any, path: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, Sequence) or isinstance(value, str):
        raise SpecError(path, "must be a list of strings")
    for i, item in enumerate(value):
        if not isinstance(item, str) or not item:
            raise SpecError(f"{path}[{i}]", "must be a non-empty string")
    return tuple(value)


def _parse_metadata(body: Mapping[str, Any]) -> tuple[str, str, str, int]:
    meta = _mapping(body.get("metadata"), "metadata", required=True)
    name = _string(meta.get("name"), "metadata.name", required=True)
    assert name is not None
    namespace = _string(meta.get("namespace"), "metadata.namespace") or "default"
    uid = _string(meta.get("uid"), "metadata.uid") or ""
    generation = _int(meta.get("generation"), "metadata.generation", 0)
    return name, namespace, uid, generation


def _parse_model(spec: Mapping[str, Any]) -> ModelSpec:
    model = _mapping(spec.get("model"), "spec.model", required=True)
    model_path = _string(model.get("path"), "spec.model.path", required=True)
    assert model_path is not None
    mount_path = _string(model.get("mountPath"), "spec.model.mountPath") or DEFAULT_MOUNT_PATH
    volume_raw = model.get("volume")
    volume = (
        None
        if volume_raw is None
        else copy.deepcopy(dict(_mapping(volume_raw, "spec.model.volume")))
    )
    if volume is not None and "name" in volume:
        raise SpecError(
            "spec.model.volume",
            "is a volume source (hostPath, persistentVolumeClaim, ...) "
            "without a name; the operator names it",
        )
    try:
        source = parse_model_source(model)
    except ModelSourceError as exc:
        raise SpecError(exc.field, exc.message) from exc
    return ModelSpec(path=model_path, mount_path=mount_path, volume=volume, source=source)


def _parse_colocation(spec: Mapping[str, Any]) -> Colocation:
    coloc = _mapping(spec.get("colocation"), "spec.colocation", required=True)
    group = _string(coloc.get("group"), "spec.colocation.group", required=True)
    assert group is not None
    priority = _int(coloc.get("priority"), "spec.colocation.priority", DEFAULT_PRIORITY)
    return Colocation(group=group, priority=priority)


def _parse_vram(spec: Mapping[str, Any]) -> tuple[str | None, int | None]:
    vram = _mapping(spec.get("vram"), "spec.vram")
    raw = vram.get("request")
    if raw is None:
        return None, None
    try:
        request_bytes = parse_quantity(raw)
    except QuantityError as exc:
        raise SpecError("spec.vram.request", str(exc)) from None
    return str(raw), request_bytes


def _parse_placement(spec: Mapping[str, Any]) -> Placement:
    placement = _mapping(spec.get("placement"), "spec.placement")
    mode = _enum(PlacementMode, placement.get("mode"), "spec.placement.mode", PlacementMode.DRA)
    node_name = _string(placement.get("nodeName"), "spec.placement.nodeName")
    devices = _strings(placement.get("devices"), "spec.placement.devices")
    return Placement(mode=mode, node_name=node_name, devices=devices)


def _parse_worker(spec: Mapping[str, Any]) -> WorkerSettings:
    worker = _mapping(spec.get("worker"), "spec.worker")
    port = _int(worker.get("port"), "spec.worker.port", DEFAULT_PORT)
    device_raw = worker.get("device")
    device = None if device_raw is None else _enum(WorkerDevice, device_raw, "spec.worker.device")
    args = _strings(worker.get("args"), "spec.worker.args")
    dtype = _string(worker.get("dtype"), "spec.worker.dtype")
    http_port = _int(worker.get("httpPort"), "spec.worker.httpPort", DEFAULT_HTTP_PORT)
    metrics_port = _int(worker.get("metricsPort"), "spec.worker.metricsPort", DEFAULT_METRICS_PORT)
    try:
        tls = parse_worker_tls(worker)
    except WorkerTlsError as exc:
        raise SpecError(exc.field, exc.message) from exc
    return WorkerSettings(
        port=port,
        device=device,
        args=args,
        dtype=dtype,
        http_port=http_port,
        tls=tls,
        metrics_port=metrics_port,
    )


def _parse_vllm(spec: Mapping[str, Any]) -> VllmSettings:
    """``spec.vllm`` as typed values (its bounds, and "backend VLLM only", are the CRD's rules;
    the worker validates the flags again)."""
    vllm = _mapping(spec.get("vllm"), "spec.vllm")
    length = vllm.get("maxModelLen")
    util = vllm.get("gpuMemoryUtilization")
    if util is not None and (isinstance(util, bool) or not isinstance(util, int | float)):
        raise SpecError("spec.vllm.gpuMemoryUtilization", f"must be a number, got {util!r}")
    eager = vllm.get("enforceEager", False)
    if not isinstance(eager, bool):
        raise SpecError("spec.vllm.enforceEager", f"must be true or false, got {eager!r}")
    flags: dict[str, bool | None] = {}
    for key in ("enablePrefixCaching", "enableChunkedPrefill"):
        value = vllm.get(key)
        if value is not None and not isinstance(value, bool):
            raise SpecError(f"spec.vllm.{key}", f"must be true or false, got {value!r}")
        flags[key] = value
    auto = vllm.get("enableAutoToolChoice", False)
    if not isinstance(auto, bool):
        raise SpecError("spec.vllm.enableAutoToolChoice", f"must be true or false, got {auto!r}")
    text: dict[str, str | None] = {}
    for key in ("kvCacheDtype", "toolCallParser", "reasoningParser", "chatTemplate"):
        value = vllm.get(key)
        if value is not None and not isinstance(value, str):
            raise SpecError(f"spec.vllm.{key}", f"must be a string, got {value!r}")
        text[key] = value
    if auto != (text["toolCallParser"] is not None):  # also the CRD's rule
        raise SpecError(
            "spec.vllm.toolCallParser", "is given exactly when spec.vllm.enableAutoToolChoice is"
        )
    seqs = vllm.get("maxNumSeqs")
    tp = vllm.get("tensorParallelSize")
    return VllmSettings(
        max_model_len=None if length is None else _int(length, "spec.vllm.maxModelLen", 0),
        gpu_memory_utilization=None if util is None else float(util),
        enforce_eager=eager,
        max_num_seqs=None if seqs is None else _int(seqs, "spec.vllm.maxNumSeqs", 0),
        kv_cache_dtype=text["kvCacheDtype"],
        enable_prefix_caching=flags["enablePrefixCaching"],
        enable_chunked_prefill=flags["enableChunkedPrefill"],
        tensor_parallel_size=None if tp is None else _int(tp, "spec.vllm.tensorParallelSize", 0),
        enable_auto_tool_choice=auto,
        tool_call_parser=text["toolCallParser"],
        reasoning_parser=text["reasoningParser"],
        chat_template=text["chatTemplate"],
    )


def _parse_template(spec: Mapping[str, Any]) -> TemplateOverrides:
    tpl = _mapping(spec.get("template"), "spec.template")
    resources_raw = tpl.get("resources")
    resources = (
        None
        if resources_raw is None
        else copy.deepcopy(dict(_mapping(resources_raw, "spec.template.resources")))
    )
    mounts = _list_of_objects(tpl.get("volumeMounts"), "spec.template.volumeMounts")
    for i, mount in enumerate(mounts):
        if str(mount.get("mountPath", "")).rstrip("/") == TOKEN_MOUNT_DIR:
            raise SpecError(
                f"spec.template.volumeMounts[{i}].mountPath",
                f"{TOKEN_MOUNT_DIR} is used by the operator",
            )
    try:
        extras = parse_pod_extras(tpl)
    except PodTemplateError as exc:
        raise SpecError(exc.field, exc.message) from exc
    return TemplateOverrides(
        resources=resources,
        env=_list_of_objects(tpl.get("env"), "spec.template.env"),
        volumes=_list_of_objects(tpl.get("volumes"), "spec.template.volumes"),
        volume_mounts=mounts,
        node_selector=_string_map(tpl.get("nodeSelector"), "spec.template.nodeSelector"),
        tolerations=_list_of_objects(tpl.get("tolerations"), "spec.template.tolerations"),
        annotations=_string_map(tpl.get("annotations"), "spec.template.annotations"),
        labels=_string_map(tpl.get("labels"), "spec.template.labels"),
        service_account_name=_string(
            tpl.get("serviceAccountName"), "spec.template.serviceAccountName"
        ),
        priority_class_name=_string(
            tpl.get("priorityClassName"), "spec.template.priorityClassName"
        ),
        extras=extras,
    )


def parse_stage(body: Mapping[str, Any]) -> StageSpec:
    """Parse an OmniStage object (``metadata`` + ``spec``) into a ``StageSpec``.

    Defaults match the CRD's, so a body that skipped the API server's defaulting parses the
    same. Raises ``SpecError`` naming the first field that cannot be read; the CRD's rules
    (bounds, patterns, reserved names, cross-field) are the API server's to enforce.
    """
    name, namespace, uid, generation = _parse_metadata(body)
    spec = _mapping(body.get("spec"), "spec", required=True)
    runner = _enum(Runner, spec.get("runner"), "spec.runner")
    backend = _enum(Backend, spec.get("backend"), "spec.backend")
    image = _string(spec.get("image"), "spec.image", required=True)
    assert image is not None
    sleep_level = _int(spec.get("sleepLevel"), "spec.sleepLevel", DEFAULT_SLEEP_LEVEL)
    gpus = _int(spec.get("gpus"), "spec.gpus", DEFAULT_GPUS)
    vram_request, vram_request_bytes = _parse_vram(spec)
    try:
        activation = parse_activation(spec)
        serving = parse_serving(spec)
    except (ActivationError, ServingError) as exc:
        raise SpecError(exc.field, exc.message) from exc
    return StageSpec(
        name=name,
        namespace=namespace,
        uid=uid,
        generation=generation,
        runner=runner,
        backend=backend,
        model=_parse_model(spec),
        image=image,
        state=_enum(DesiredState, spec.get("state"), "spec.state", DesiredState.ACTIVE),
        sleep_level=sleep_level,
        colocation=_parse_colocation(spec),
        gpus=gpus,
        vram_request=vram_request,
        vram_request_bytes=vram_request_bytes,
        placement=_parse_placement(spec),
        worker=_parse_worker(spec),
        template=_parse_template(spec),
        drain_timeout_s=_int(
            spec.get("drainTimeoutSeconds"), "spec.drainTimeoutSeconds", DEFAULT_DRAIN_TIMEOUT_S
        ),
        asleep_components=tuple(
            sorted(set(_strings(spec.get("asleepComponents"), "spec.asleepComponents")))
        ),
        vllm=_parse_vllm(spec),
        activation=activation,
        serving=serving,
    )
