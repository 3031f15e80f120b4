"""The digest of the spec fields a running worker pod cannot follow (pure, no network).

Public API (stable):
    ``pod_spec_hash(stage) -> str``: 16 hex digits over the spec fields a running pod cannot
    follow (image, runner, backend, model, gpus, placement, worker, template, group); the pod
    carries it as ``omnistage.io/pod-spec-hash``, so a differing hash means "recreate the
    pod". ``state``, ``sleepLevel``, ``priority`` and ``vram`` are left out: they are
    followed over gRPC or by the arbiter without a restart (except for a VLLM stage: its
    ``vllm_args``, ``vram.request`` included, fix the engine's memory budget at its start).
    ``pod_spec_hash(stage, profile)``: the same, with the operator's own settings that shape
    every worker pod (:class:`PodProfile`: log format, worker credentials), so changing them
    replaces the pods; the default profile adds nothing (older pods keep their hash).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from omnistage_operator.api.model_source import source_hash_fields
from omnistage_operator.api.pod_template import hash_payload
from omnistage_operator.api.serving import Serving, serving_args
from omnistage_operator.api.spec import DEFAULT_METRICS_PORT, Backend, StageSpec
from omnistage_operator.k8s.worker_command import vllm_args

__all__ = ["DEFAULT_PROFILE", "PodProfile", "pod_spec_hash"]


@dataclass(frozen=True)
class PodProfile:
    """The operator's settings that every worker pod is built with."""

    log_format: str = "text"  # the worker's --log-format (OMNISTAGE_LOG_FORMAT)
    # The worker flags of Kubernetes-issued credentials; empty: the shared token's Secret.
    credential_args: tuple[str, ...] = ()
    # The node directory the group's hand-off directories are under (--handoff-host-path).
    handoff_host_path: str = ""


DEFAULT_PROFILE: Final = PodProfile()


def pod_spec_hash(stage: StageSpec, profile: PodProfile = DEFAULT_PROFILE) -> str:
    """A short digest of the spec fields (and operator settings) that need a new pod when they
    change."""
    tpl = stage.template
    payload: dict[str, object] = {
        "image": stage.image,
        "runner": stage.runner.value,
        "backend": stage.backend.value,
        "model": [stage.model.path, stage.model.mount_path, stage.model.volume],
        "gpus": stage.gpus,
        "group": stage.group,
        "placement": [
            stage.placement.mode.value,
            stage.placement.node_name,
            stage.placement.devices,
        ],
        "worker": [
            stage.worker.port,
            None if stage.worker.device is None else stage.worker.device.value,
            stage.worker.args,
            stage.worker.dtype,
            stage.worker.http_port,
            # Only when changed: pods made before the field existed keep their hash.
            *([m] if (m := stage.worker.metrics_port) != DEFAULT_METRICS_PORT else []),
        ],
        "activation": [stage.activation.policy.value, stage.activation.hold_timeout_s],
        "template": [
            tpl.resources,
            tpl.env,
            tpl.volumes,
            tpl.volume_mounts,
            tpl.node_selector,
            tpl.tolerations,
            tpl.annotations,
            tpl.labels,
            tpl.service_account_name,
            tpl.priority_class_name,
        ],
    }
    if stage.backend is Backend.VLLM:  # the engine's memory budget is fixed when it starts
        payload["vllm"] = vllm_args(stage)
    if stage.serving != Serving():  # (absent when default: the pods of older specs stay)
        payload["serving"] = [*serving_args(stage.serving), stage.serving.auth_secret]
    if stage.model.source is not None:  # (the same)
        payload["modelSource"] = source_hash_fields(stage.model.source)
    if stage.worker.tls.enabled:  # (the same)
        payload["tls"] = [stage.worker.tls.secret_name, stage.worker.tls.health_port]
    if profile != DEFAULT_PROFILE:  # (the same)
        settings: list[object] = [profile.log_format, list(profile.credential_args)]
        if profile.handoff_host_path:  # (pods without it keep their hash)
            settings.append(profile.handoff_host_path)
        payload["operator"] = settings
    extras = hash_payload(tpl.extras)  # (the same)
    if extras is not None:
        payload["podExtras"] = extras
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=_jsonable)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _jsonable(value: object) -> object:
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(f"cannot hash {type(value).__name__}")
