"""The OmniStage spec as typed, validated Python values (pure logic, no kopf, no network).

The CRD's structural schema (crds/omnistages.omnistage.io.yaml) refuses most bad manifests at
the API server; ``parse_stage`` re-checks everything (bodies may come from tests or from an
older CRD) and adds the rules the schema cannot express, raising ``SpecError(field, message)``
with the offending field as a dotted path (``spec.colocation.group``).

Public API (stable):

Enums (``StrEnum``; values are exactly the CRD's):
    ``Runner`` (``DIFFUSION="Diffusion"``, ``AR="AR"``; ``.cli`` -> ``"diffusion"|"ar"``)
    ``Backend`` (``DIFFUSERS``, ``TRANSFORMERS``, ``VLLM``; ``.cli`` -> lower-case worker flag)
    ``DesiredState`` (``ACTIVE="Active"``, ``ASLEEP="Asleep"``; ``.cli`` -> ``"active"|"asleep"``)
    ``Phase`` (status.state: ``PENDING LOADING ACTIVE SLEEPING ASLEEP WAKING WAITING FAILED``)
    ``PlacementMode`` (``DRA``, ``EXPLICIT="Explicit"``)
    ``WorkerDevice`` (``AUTO="auto"``, ``CPU="cpu"``, ``CUDA="cuda"``)
    ``MemorySource`` (``NVML="nvml"``, ``ACCOUNTING="accounting"``)
Constants: ``GROUP="omnistage.io"``, ``VERSION="v1alpha1"``, ``API_VERSION``, ``KIND="OmniStage"``,
    ``PLURAL="omnistages"``, defaults ``DEFAULT_*``, bounds ``MIN_/MAX_PRIORITY``, ``MAX_GPUS``,
    ``MIN_/MAX_PORT``, ``MIN_/MAX_DRAIN_TIMEOUT_S``, ``MAX_STAGE_NAME_LENGTH``; ``DTYPES``;
    ``BACKENDS_FOR_RUNNER``; names the operator owns: ``RESERVED_ENV``, ``RESERVED_ARGS``,
    ``RESERVED_VOLUMES``, ``TOKEN_MOUNT_DIR``.
Dataclasses (frozen; mapping-valued fields are excluded from hashing):
    ``ModelSpec(path, mount_path, volume)``, ``Colocation(group, priority)``,
    ``Placement(mode, node_name, devices)``, ``WorkerSettings(port, device, args, dtype)``,
    ``TemplateOverrides(resources, env, volumes, volume_mounts, node_selector, tolerations,
    annotations, labels, service_account_name, priority_class_name)``,
    ``StageSpec(name, namespace, uid, generation, runner, backend, model, image, state,
    sleep_level, colocation, gpus, vram_request, vram_request_bytes, placement, worker,
    template, drain_timeout_s)`` with properties ``group``, ``priority``, ``key``
    (``"ns/name"``), ``wants_active``.
Functions:
    ``parse_stage(body: Mapping[str, Any]) -> StageSpec`` (raises ``SpecError``)
Errors:
    ``SpecError(field: str, message: str)`` (``ValueError``; ``str()`` is ``"field: message"``).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, TypeVar

from omnistage_operator.activation import Activation, ActivationError, parse_activation
from omnistage_operator.labels import RESERVED_LABELS
from omnistage_operator.quantities import QuantityError, parse_quantity

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
    "RESERVED_ENV",
    "RESERVED_VOLUMES",
    "TOKEN_MOUNT_DIR",
    "VERSION",
    "Backend",
    "Colocation",
    "DesiredState",
    "MemorySource",
    "ModelSpec",
    "Phase",
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
DEFAULT_DRAIN_TIMEOUT_S = 600
MIN_DRAIN_TIMEOUT_S, MAX_DRAIN_TIMEOUT_S = 1, 86400
MIN_PRIORITY, MAX_PRIORITY = -1000, 1000
MAX_GPUS = 8
MIN_PORT, MAX_PORT = 1024, 65535
# "<stage>-worker" names a Service, which must be a DNS-1035 label of at most 63 characters.
MAX_STAGE_NAME_LENGTH = 56

# Environment variables and worker flags the operator sets itself; overrides may not touch them.
RESERVED_ENV = frozenset(
    {
        "POD_IP",
        "POD_NAME",
        "POD_NAMESPACE",
        "NODE_NAME",
        "OMNISTAGE_STAGE",
        "NVIDIA_VISIBLE_DEVICES",
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
        "--dtype",
        "--drain-timeout",
        "--activation",
        "--hold-timeout",
        "--http-port",
    }
)
# Names the builders use for their own volumes and mount points.
RESERVED_VOLUMES = frozenset({"omnistage-token", "model"})
TOKEN_MOUNT_DIR = "/var/run/secrets/omnistage"
DTYPES = ("auto", "float32", "float16", "bfloat16")

_E = TypeVar("_E", bound=StrEnum)
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


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


class Phase(StrEnum):
    """``status.state``: what the operator observed."""

    PENDING = "Pending"
    LOADING = "Loading"
    ACTIVE = "Active"
    SLEEPING = "Sleeping"
    ASLEEP = "Asleep"
    WAKING = "Waking"
    WAITING = "Waiting"
    FAILED = "Failed"


class PlacementMode(StrEnum):
    """``spec.placement.mode``: a shared DRA claim per group, or an explicit node and devices."""

    DRA = "DRA"
    EXPLICIT = "Explicit"


class WorkerDevice(StrEnum):
    """``spec.worker.device``: the torch device the worker uses."""

    AUTO = "auto"
    CPU = "cpu"
    CUDA = "cuda"


class MemorySource(StrEnum):
    """``status.memory.source``: how the memory figures were measured."""

    NVML = "nvml"
    ACCOUNTING = "accounting"


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
    # spec.activation: Manual (spec.state only) or OnDemand (requests wake the stage).
    activation: Activation = field(default_factory=Activation)

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


def _string(value: Any, path: str, *, required: bool = False, max_length: int = 253) -> str | None:
    if value is None or value == "":
        if required:
            raise SpecError(path, "is required")
        return None
    if not isinstance(value, str):
        raise SpecError(path, f"must be a string, got {type(value).__name__}")
    if len(value) > max_length:
        raise SpecError(path, f"must be at most {max_length} characters")
    return value


def _int(value: Any, path: str, default: int, low: int, high: int) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(path, f"must be an integer, got {value!r}")
    if not low <= value <= high:
        raise SpecError(path, f"must be between {low} and {high}, got {value}")
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


def _absolute_path(value: Any, path: str, *, required: bool) -> str | None:
    text = _string(value, path, required=required, max_length=4096)
    if text is not None and not text.startswith("/"):
        raise SpecError(path, f"must be an absolute path, got {text!r}")
    return text


# ---------------------------------------------------------------------------------------------


def _parse_metadata(body: Mapping[str, Any]) -> tuple[str, str, str, int]:
    meta = _mapping(body.get("metadata"), "metadata", required=True)
    name = _string(meta.get("name"), "metadata.name", required=True)
    assert name is not None
    if len(name) > MAX_STAGE_NAME_LENGTH or not _DNS_1035.match(name):
        raise SpecError(
            "metadata.name",
            f"must be a DNS-1035 label of at most {MAX_STAGE_NAME_LENGTH} characters "
            f"(its Service '<name>-worker' must fit 63), got {name!r}",
        )
    namespace = _string(meta.get("namespace"), "metadata.namespace") or "default"
    uid = _string(meta.get("uid"), "metadata.uid") or ""
    generation = meta.get("generation", 0)
    if isinstance(generation, bool) or not isinstance(generation, int):
        raise SpecError("metadata.generation", "must be an integer")
    return name, namespace, uid, generation


def _parse_model(spec: Mapping[str, Any]) -> ModelSpec:
    model = _mapping(spec.get("model"), "spec.model", required=True)
    model_path = _absolute_path(model.get("path"), "spec.model.path", required=True)
    assert model_path is not None
    mount_path = (
        _absolute_path(model.get("mountPath"), "spec.model.mountPath", required=False)
        or DEFAULT_MOUNT_PATH
    )
    if mount_path.rstrip("/") == TOKEN_MOUNT_DIR or mount_path.startswith(TOKEN_MOUNT_DIR + "/"):
        raise SpecError("spec.model.mountPath", f"must not be under {TOKEN_MOUNT_DIR}")
    volume_raw = model.get("volume")
    volume = (
        None
        if volume_raw is None
        else copy.deepcopy(dict(_mapping(volume_raw, "spec.model.volume")))
    )
    if volume is not None:
        mount = mount_path.rstrip("/") or "/"
        if model_path != mount and not model_path.startswith(mount.rstrip("/") + "/"):
            raise SpecError(
                "spec.model.path",
                f"must be under spec.model.mountPath ({mount_path}) when spec.model.volume is set, "
                f"got {model_path!r}",
            )
        if "name" in volume:
            raise SpecError(
                "spec.model.volume",
                "is a volume source (hostPath, persistentVolumeClaim, ...) "
                "without a name; the operator names it",
            )
        if not volume:
            raise SpecError("spec.model.volume", "must name a volume source")
    return ModelSpec(path=model_path, mount_path=mount_path, volume=volume)


def _parse_colocation(spec: Mapping[str, Any]) -> Colocation:
    coloc = _mapping(spec.get("colocation"), "spec.colocation", required=True)
    group = _string(coloc.get("group"), "spec.colocation.group", required=True, max_length=63)
    assert group is not None
    if not _DNS_LABEL.match(group):
        raise SpecError(
            "spec.colocation.group",
            f"must be a DNS label (lower-case letters, digits and '-'), got {group!r}",
        )
    priority = _int(
        coloc.get("priority"),
        "spec.colocation.priority",
        DEFAULT_PRIORITY,
        MIN_PRIORITY,
        MAX_PRIORITY,
    )
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
    if request_bytes <= 0:
        raise SpecError("spec.vram.request", f"must be greater than zero, got {raw!r}")
    return str(raw), request_bytes


def _parse_placement(spec: Mapping[str, Any]) -> Placement:
    placement = _mapping(spec.get("placement"), "spec.placement")
    mode = _enum(PlacementMode, placement.get("mode"), "spec.placement.mode", PlacementMode.DRA)
    node_name = _string(placement.get("nodeName"), "spec.placement.nodeName")
    devices = _strings(placement.get("devices"), "spec.placement.devices")
    if mode is PlacementMode.EXPLICIT:
        if node_name is None:
            raise SpecError("spec.placement.nodeName", "is required when mode is Explicit")
        if not devices:
            raise SpecError(
                "spec.placement.devices", "needs at least one device when mode is Explicit"
            )
    if len(set(devices)) != len(devices):
        raise SpecError("spec.placement.devices", "must not repeat a device")
    return Placement(mode=mode, node_name=node_name, devices=devices)


def _parse_worker(spec: Mapping[str, Any]) -> WorkerSettings:
    worker = _mapping(spec.get("worker"), "spec.worker")
    port = _int(worker.get("port"), "spec.worker.port", DEFAULT_PORT, MIN_PORT, MAX_PORT)
    device_raw = worker.get("device")
    device = None if device_raw is None else _enum(WorkerDevice, device_raw, "spec.worker.device")
    args = _strings(worker.get("args"), "spec.worker.args")
    for i, arg in enumerate(args):
        flag = arg.split("=", 1)[0]
        if flag in RESERVED_ARGS:
            raise SpecError(
                f"spec.worker.args[{i}]",
                f"{flag} is set by the operator from the spec; use the matching spec field",
            )
    dtype = _string(worker.get("dtype"), "spec.worker.dtype")
    if dtype is not None and dtype not in DTYPES:
        raise SpecError("spec.worker.dtype", f"must be one of {', '.join(DTYPES)}, got {dtype!r}")
    http_port = _int(
        worker.get("httpPort"), "spec.worker.httpPort", DEFAULT_HTTP_PORT, MIN_PORT, MAX_PORT
    )
    if http_port == port:
        raise SpecError("spec.worker.httpPort", f"must differ from spec.worker.port ({port})")
    return WorkerSettings(port=port, device=device, args=args, dtype=dtype, http_port=http_port)


def _parse_template(spec: Mapping[str, Any]) -> TemplateOverrides:
    tpl = _mapping(spec.get("template"), "spec.template")
    resources_raw = tpl.get("resources")
    resources = None
    if resources_raw is not None:
        resources = copy.deepcopy(dict(_mapping(resources_raw, "spec.template.resources")))
        if "claims" in resources:
            raise SpecError(
                "spec.template.resources.claims", "is managed by the operator (spec.placement)"
            )
    env = _list_of_objects(tpl.get("env"), "spec.template.env")
    for i, var in enumerate(env):
        name = var.get("name")
        if not isinstance(name, str) or not name:
            raise SpecError(f"spec.template.env[{i}].name", "is required")
        if name in RESERVED_ENV:
            raise SpecError(f"spec.template.env[{i}].name", f"{name} is set by the operator")
    volumes = _list_of_objects(tpl.get("volumes"), "spec.template.volumes")
    seen: set[str] = set()
    for i, vol in enumerate(volumes):
        name = vol.get("name")
        if not isinstance(name, str) or not name:
            raise SpecError(f"spec.template.volumes[{i}].name", "is required")
        if name in seen:
            raise SpecError(f"spec.template.volumes[{i}].name", f"repeats the volume {name!r}")
        seen.add(name)
        if name in RESERVED_VOLUMES:
            raise SpecError(f"spec.template.volumes[{i}].name", f"{name!r} is used by the operator")
    mounts = _list_of_objects(tpl.get("volumeMounts"), "spec.template.volumeMounts")
    for i, mount in enumerate(mounts):
        if not isinstance(mount.get("name"), str) or not isinstance(mount.get("mountPath"), str):
            raise SpecError(f"spec.template.volumeMounts[{i}]", "needs name and mountPath")
        if mount["mountPath"].rstrip("/") == TOKEN_MOUNT_DIR:
            raise SpecError(
                f"spec.template.volumeMounts[{i}].mountPath",
                f"{TOKEN_MOUNT_DIR} is used by the operator",
            )
    labels = _string_map(tpl.get("labels"), "spec.template.labels")
    for key in labels:
        if key in RESERVED_LABELS:
            raise SpecError(f"spec.template.labels.{key}", "is set by the operator")
    return TemplateOverrides(
        resources=resources,
        env=env,
        volumes=volumes,
        volume_mounts=mounts,
        node_selector=_string_map(tpl.get("nodeSelector"), "spec.template.nodeSelector"),
        tolerations=_list_of_objects(tpl.get("tolerations"), "spec.template.tolerations"),
        annotations=_string_map(tpl.get("annotations"), "spec.template.annotations"),
        labels=labels,
        service_account_name=_string(
            tpl.get("serviceAccountName"), "spec.template.serviceAccountName"
        ),
        priority_class_name=_string(
            tpl.get("priorityClassName"), "spec.template.priorityClassName"
        ),
    )


def parse_stage(body: Mapping[str, Any]) -> StageSpec:
    """Parse an OmniStage object (``metadata`` + ``spec``) into a ``StageSpec``.

    Defaults match the CRD's, so a body that skipped the API server's defaulting parses the
    same. Raises ``SpecError`` naming the first invalid field.
    """
    name, namespace, uid, generation = _parse_metadata(body)
    spec = _mapping(body.get("spec"), "spec", required=True)
    runner = _enum(Runner, spec.get("runner"), "spec.runner")
    backend = _enum(Backend, spec.get("backend"), "spec.backend")
    if backend not in BACKENDS_FOR_RUNNER[runner]:
        allowed = " or ".join(sorted(b.value for b in BACKENDS_FOR_RUNNER[runner]))
        raise SpecError(
            "spec.backend", f"runner {runner.value} needs backend {allowed}, got {backend.value}"
        )
    image = _string(spec.get("image"), "spec.image", required=True, max_length=1024)
    assert image is not None
    sleep_level = _int(spec.get("sleepLevel"), "spec.sleepLevel", DEFAULT_SLEEP_LEVEL, 1, 2)
    gpus = _int(spec.get("gpus"), "spec.gpus", DEFAULT_GPUS, 0, MAX_GPUS)
    vram_request, vram_request_bytes = _parse_vram(spec)
    try:
        activation = parse_activation(spec)
    except ActivationError as exc:
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
            spec.get("drainTimeoutSeconds"),
            "spec.drainTimeoutSeconds",
            DEFAULT_DRAIN_TIMEOUT_S,
            MIN_DRAIN_TIMEOUT_S,
            MAX_DRAIN_TIMEOUT_S,
        ),
        activation=activation,
    )
