"""Reading a stored OmniStage body into a ``StageSpec`` (pure logic, no kopf, no network).

The CRD (crds/omnistages.omnistage.io.yaml) refuses bad manifests at the API server first.
``parse_stage`` only reads a stored body into the typed values of :mod:`omnistage_operator.api.spec`
with the CRD's defaults, raising ``SpecError(field, message)`` (a dotted path,
``spec.colocation.group``) when the body cannot be read at all (a missing required field, a
value of the wrong type or outside an enum), and keeps the rules the CRD does not state: a
model volume carries no name, and no extra mount shadows the worker token.

Public API (stable):
    ``parse_stage(body: Mapping[str, Any]) -> StageSpec`` (raises ``SpecError``)
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import Any, TypeVar

from omnistage_operator.api.activation import ActivationError, parse_activation
from omnistage_operator.api.model_source import ModelSourceError, parse_model_source
from omnistage_operator.api.pod_template import PodTemplateError, parse_pod_extras
from omnistage_operator.api.serving import ServingError, parse_serving
from omnistage_operator.api.spec import (
    DEFAULT_DRAIN_TIMEOUT_S,
    DEFAULT_GPUS,
    DEFAULT_HTTP_PORT,
    DEFAULT_METRICS_PORT,
    DEFAULT_MOUNT_PATH,
    DEFAULT_PORT,
    DEFAULT_PRIORITY,
    DEFAULT_SLEEP_LEVEL,
    TOKEN_MOUNT_DIR,
    Backend,
    Colocation,
    DesiredState,
    ModelSpec,
    Placement,
    PlacementMode,
    Runner,
    SpecError,
    StageSpec,
    TemplateOverrides,
    VllmSettings,
    WorkerDevice,
    WorkerSettings,
)
from omnistage_operator.api.worker_tls import WorkerTlsError, parse_worker_tls
from omnistage_worker.quantities import QuantityError, parse_quantity

__all__ = ["parse_stage"]

_E = TypeVar("_E", bound=StrEnum)

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
