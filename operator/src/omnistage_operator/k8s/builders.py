"""Pure builders of the child objects of an OmniStage, as plain dicts (no kopf, no network).

Every function returns a fresh dict the caller may mutate; nothing is shared with the
``StageSpec`` it came from. The worker's command line is
:mod:`omnistage_operator.k8s.worker_command`, the pod's spec hash
:mod:`omnistage_operator.k8s.pod_hash`, the token Secret :mod:`omnistage_operator.k8s.token_secret`.

Public API (stable):

Names and constants:
    ``pod_name(stage_name) -> "<stage>-worker"``, ``service_name(stage_name) -> "<stage>-worker"``,
    ``claim_name(group) -> "omnistage-<group>-gpus"``, ``pod_claim_name(stage) -> str | None``
    (the group claim a stage's pod references: DRA mode with ``gpus > 0``, else ``None``).
    ``TOKEN_VOLUME="omnistage-token"``, ``MODEL_VOLUME="model"``,
    ``DEFAULT_DEVICE_CLASS="gpu.nvidia.com"``, ``CONTAINER_NAME="worker"``, ``PORT_NAME="grpc"``,
    ``POD_CLAIM_REF="gpus"``, ``READINESS_SERVICE="omnistage.worker.v1.SleepService"``,
    ``LIVENESS_SERVICE=""``, ``WORKER_COMMAND=["omnistage-worker"]``,
    annotation keys ``INITIAL_STATE_ANNOTATION``, ``SLEEP_LEVEL_ANNOTATION``,
    ``GENERATION_ANNOTATION``, ``POD_SPEC_HASH_ANNOTATION``.
Builders:
    ``owner_reference(body) -> dict`` (controller=true, blockOwnerDeletion=true)
    ``build_worker_pod(stage, *, initial_state, owner, claim_name=<pod_claim_name(stage)>,
    token_secret_name=TOKEN_SECRET_NAME, sleep_level=None, epoch=0, profile=DEFAULT_PROFILE)
    -> dict`` (``profile``: the operator's log format, passed as ``OMNISTAGE_LOG_FORMAT`` unless
    the stage's env sets it, and credentials, both in the pod's spec hash; a VLLM stage
    started asleep starts pre-warmed at level 2 whatever ``sleep_level`` or the spec says,
    see ``worker_command.start_level``: vLLM imported, no engine, nothing on the device until
    its first wake starts the engine)
    ``build_service(stage, *, owner) -> dict``
    ``build_group_claim(namespace, group, gpus, device_class=DEFAULT_DEVICE_CLASS) -> dict``

Decisions beyond the contract:
    ``restartPolicy: Never``: a worker's initial state is fixed in its args, so a kubelet
    restart could bring an old "active" worker back onto memory another stage now holds; the
    operator recreates a failed pod with the state the arbiter chooses instead.
    ``terminationMessagePolicy: FallbackToLogsOnError``: a worker that exits is explained in
    its pod status (the operator shows it in the stage's status and Events).
    ``NVIDIA_VISIBLE_DEVICES`` is set only in Explicit placement (the spec's device list); in
    DRA mode the devices come from the claim, and the worker image's default sees none.
    ``enableServiceLinks: false`` and, unless ``template.serviceAccountName`` is set,
    ``automountServiceAccountToken: false``: the worker never talks to the API server.
    The pod and container security contexts default to what the ``restricted`` Pod Security
    Standard admits (:mod:`omnistage_operator.api.pod_template`, which merges the template's).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, Final

from omnistage_operator.api.labels import group_labels, stage_labels, stage_selector
from omnistage_operator.api.model_source import source_init_container
from omnistage_operator.api.pod_template import apply_pod_extras
from omnistage_operator.api.serving import serving_volume
from omnistage_operator.api.spec import (
    API_VERSION,
    KIND,
    TOKEN_MOUNT_DIR,
    DesiredState,
    PlacementMode,
    StageSpec,
)
from omnistage_operator.api.worker_tls import HEALTH_PORT_NAME, probe_port, tls_volume
from omnistage_operator.k8s.handoff_volume import (
    HANDOFF_DIR_ENV,
    HANDOFF_MOUNT_DIR,
    handoff_volume,
)
from omnistage_operator.k8s.pod_hash import DEFAULT_PROFILE, PodProfile, pod_spec_hash
from omnistage_operator.k8s.token_secret import TOKEN_SECRET_KEY, TOKEN_SECRET_NAME
from omnistage_operator.k8s.worker_command import start_level, worker_args

__all__ = [
    "CONTAINER_NAME",
    "DEFAULT_DEVICE_CLASS",
    "GENERATION_ANNOTATION",
    "HTTP_PORT_NAME",
    "INITIAL_STATE_ANNOTATION",
    "LIVENESS_SERVICE",
    "METRICS_PORT_NAME",
    "MODEL_VOLUME",
    "POD_CLAIM_REF",
    "POD_SPEC_HASH_ANNOTATION",
    "PORT_NAME",
    "READINESS_SERVICE",
    "SLEEP_LEVEL_ANNOTATION",
    "TOKEN_VOLUME",
    "WORKER_COMMAND",
    "build_group_claim",
    "build_service",
    "build_worker_pod",
    "claim_name",
    "owner_reference",
    "pod_claim_name",
    "pod_name",
    "service_name",
]

TOKEN_VOLUME: Final = "omnistage-token"
MODEL_VOLUME: Final = "model"
DEFAULT_DEVICE_CLASS: Final = "gpu.nvidia.com"
CONTAINER_NAME: Final = "worker"
PORT_NAME: Final = "grpc"
HTTP_PORT_NAME: Final = "http"
METRICS_PORT_NAME: Final = "metrics"
POD_CLAIM_REF: Final = "gpus"
READINESS_SERVICE: Final = "omnistage.worker.v1.SleepService"
LIVENESS_SERVICE: Final = ""
WORKER_COMMAND: Final = ("omnistage-worker",)
TERMINATION_GRACE_SECONDS: Final = 30
LOG_FORMAT_ENV: Final = "OMNISTAGE_LOG_FORMAT"  # the worker's --log-format default

INITIAL_STATE_ANNOTATION: Final = "omnistage.io/initial-state"
SLEEP_LEVEL_ANNOTATION: Final = "omnistage.io/initial-sleep-level"
GENERATION_ANNOTATION: Final = "omnistage.io/spec-generation"
POD_SPEC_HASH_ANNOTATION: Final = "omnistage.io/pod-spec-hash"

_NOT_GIVEN: Final = "\0not-given"


def pod_name(stage_name: str) -> str:
    """Name of a stage's worker Pod."""
    return f"{stage_name}-worker"


def service_name(stage_name: str) -> str:
    """Name of a stage's Service (same as its pod)."""
    return f"{stage_name}-worker"


def claim_name(group: str) -> str:
    """Name of a colocation group's shared DRA ResourceClaim."""
    return f"omnistage-{group}-gpus"


def pod_claim_name(stage: StageSpec) -> str | None:
    """The claim the stage's pod references: its group's claim in DRA mode with GPUs, else None."""
    if stage.placement.mode is PlacementMode.DRA and stage.gpus > 0:
        return claim_name(stage.group)
    return None


def owner_reference(body: Mapping[str, Any]) -> dict[str, Any]:
    """An owner reference to the OmniStage ``body`` (controller, blocks owner deletion)."""
    meta = body.get("metadata") or {}
    name, uid = meta.get("name"), meta.get("uid")
    if not name or not uid:
        raise ValueError("owner_reference needs metadata.name and metadata.uid")
    return {
        "apiVersion": str(body.get("apiVersion") or API_VERSION),
        "kind": str(body.get("kind") or KIND),
        "name": str(name),
        "uid": str(uid),
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _field_env(name: str, field_path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": field_path}}}


def _worker_env(stage: StageSpec, profile: PodProfile) -> list[dict[str, Any]]:
    env = [
        _field_env("POD_IP", "status.podIP"),
        _field_env("POD_NAME", "metadata.name"),
        _field_env("POD_NAMESPACE", "metadata.namespace"),
        _field_env("NODE_NAME", "spec.nodeName"),
        {"name": "OMNISTAGE_STAGE", "value": stage.name},
    ]
    if stage.placement.mode is PlacementMode.EXPLICIT:
        env.append({"name": "NVIDIA_VISIBLE_DEVICES", "value": ",".join(stage.placement.devices)})
    own = {var.get("name") for var in stage.template.env}
    if profile.log_format != DEFAULT_PROFILE.log_format and LOG_FORMAT_ENV not in own:
        env.append({"name": LOG_FORMAT_ENV, "value": profile.log_format})
    if profile.handoff_host_path:
        env.append({"name": HANDOFF_DIR_ENV, "value": HANDOFF_MOUNT_DIR})
    env += [copy.deepcopy(dict(var)) for var in stage.template.env]
    return env


def _grpc_probe(port: int, service: str, *, period: int, failures: int) -> dict[str, Any]:
    return {
        "grpc": {"port": port, "service": service},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


def build_worker_pod(
    stage: StageSpec,
    *,
    initial_state: DesiredState,
    owner: Mapping[str, Any],
    claim_name: str | None = _NOT_GIVEN,
    token_secret_name: str = TOKEN_SECRET_NAME,
    sleep_level: int | None = None,
    epoch: int = 0,
    profile: PodProfile = DEFAULT_PROFILE,
) -> dict[str, Any]:
    """The stage's worker Pod.

    ``initial_state`` is what the worker starts as (the arbiter decides: Asleep when others
    hold the group's memory). ``owner`` is an ``owner_reference``. ``claim_name`` defaults to
    ``pod_claim_name(stage)``; pass ``None`` for no DRA claim. ``sleep_level`` overrides the
    spec's level for an asleep start (not a VLLM stage's: 2, ``start_level``). ``epoch``: the
    creating leader's epoch (``--epoch``); it is not part of ``pod_spec_hash``, so a new leader
    does not replace running pods.
    ``profile``: the operator's settings every worker pod is built with (in the hash).
    """
    claim = pod_claim_name(stage) if claim_name == _NOT_GIVEN else claim_name
    if stage.placement.mode is PlacementMode.EXPLICIT and claim is not None:
        raise ValueError("a stage with Explicit placement does not use a DRA claim")
    mounts, volumes = _pod_volumes(stage, token_secret_name)
    handoff = handoff_volume(stage, profile.handoff_host_path)
    if handoff is not None:
        mounts.append(handoff[0])
        volumes.append(handoff[1])
    container = _worker_container(
        stage, initial_state, sleep_level, claim, mounts, epoch=epoch, profile=profile
    )
    level = start_level(stage, initial_state, sleep_level)
    spec = _pod_spec(stage, container, volumes, claim)
    apply_pod_extras(stage.template.extras, spec, container)
    if stage.model.source is not None:  # fetch the model before anything else runs
        fetch = source_init_container(
            stage.model.source,
            image=stage.image,
            volume=MODEL_VOLUME,
            mount_path=stage.model.mount_path,
            dest=stage.model.path,
            security_context=container["securityContext"],
        )
        spec["initContainers"] = [fetch, *spec.get("initContainers", [])]
    annotations = {
        **stage.template.annotations,
        INITIAL_STATE_ANNOTATION: DesiredState(initial_state).value,
        SLEEP_LEVEL_ANNOTATION: str(level),
        GENERATION_ANNOTATION: str(stage.generation),
        POD_SPEC_HASH_ANNOTATION: pod_spec_hash(stage, profile),
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod_name(stage.name),
            "namespace": stage.namespace,
            "labels": {**stage.template.labels, **stage_labels(stage.name, stage.group)},
            "annotations": annotations,
            "ownerReferences": [copy.deepcopy(dict(owner))],
        },
        "spec": spec,
    }


def _pod_volumes(
    stage: StageSpec, token_secret_name: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The worker's volume mounts and the pod's volumes: the token, the model, the template's."""
    tpl = stage.template
    mounts: list[dict[str, Any]] = [
        {"name": TOKEN_VOLUME, "mountPath": TOKEN_MOUNT_DIR, "readOnly": True}
    ]
    volumes: list[dict[str, Any]] = [
        {
            "name": TOKEN_VOLUME,
            "secret": {
                "secretName": token_secret_name,
                "items": [{"key": TOKEN_SECRET_KEY, "path": TOKEN_SECRET_KEY}],
                "defaultMode": 0o400,
            },
        }
    ]
    http_token = serving_volume(stage.serving)
    if http_token is not None:
        mounts.append(http_token[0])
        volumes.append(http_token[1])
    tls = tls_volume(stage.worker.tls)
    if tls is not None:
        mounts.append(tls[0])
        volumes.append(tls[1])
    if stage.model.volume is not None or stage.model.source is not None:
        # (spec.model.source without a volume: an emptyDir the init container fills)
        held = dict(stage.model.volume) if stage.model.volume is not None else {"emptyDir": {}}
        mounts.append({"name": MODEL_VOLUME, "mountPath": stage.model.mount_path, "readOnly": True})
        volumes.append({"name": MODEL_VOLUME, **copy.deepcopy(held)})
    mounts += [copy.deepcopy(dict(m)) for m in tpl.volume_mounts]
    volumes += [copy.deepcopy(dict(v)) for v in tpl.volumes]
    return mounts, volumes


def _worker_container(
    stage: StageSpec,
    initial_state: DesiredState,
    sleep_level: int | None,
    claim: str | None,
    mounts: list[dict[str, Any]],
    *,
    epoch: int = 0,
    profile: PodProfile = DEFAULT_PROFILE,
) -> dict[str, Any]:
    """The worker container: command, args, env, gRPC probes, mounts and resources."""
    port = stage.worker.port
    probed = probe_port(stage.worker.tls, port)  # plaintext health beside a TLS port
    ports = [
        {"name": PORT_NAME, "containerPort": port, "protocol": "TCP"},
        {"name": HTTP_PORT_NAME, "containerPort": stage.worker.http_port, "protocol": "TCP"},
        {"name": METRICS_PORT_NAME, "containerPort": stage.worker.metrics_port, "protocol": "TCP"},
    ]
    if probed != port:
        ports.append({"name": HEALTH_PORT_NAME, "containerPort": probed, "protocol": "TCP"})
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": stage.image,
        "command": list(WORKER_COMMAND),
        "args": worker_args(
            stage, initial_state=initial_state, sleep_level=sleep_level, epoch=epoch
        ),
        "env": _worker_env(stage, profile),
        "ports": ports,
        "readinessProbe": _grpc_probe(probed, READINESS_SERVICE, period=5, failures=3),
        "livenessProbe": _grpc_probe(probed, LIVENESS_SERVICE, period=10, failures=6),
        "volumeMounts": mounts,
        # A worker that exits at start (bad model path, refused flag) says why in its
        # termination message; without one, the kubelet keeps its last log lines instead.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    resources: dict[str, Any] = copy.deepcopy(dict(stage.template.resources or {}))
    if claim is not None:
        resources["claims"] = [{"name": POD_CLAIM_REF}]
    if resources:
        container["resources"] = resources
    return container


def _pod_spec(
    stage: StageSpec,
    container: dict[str, Any],
    volumes: list[dict[str, Any]],
    claim: str | None,
) -> dict[str, Any]:
    """The pod spec: never restarted (the operator decides), the claim or the explicit node,
    and the template's scheduling fields."""
    tpl = stage.template
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": TERMINATION_GRACE_SECONDS,
        "enableServiceLinks": False,
    }
    if claim is not None:
        pod_spec["resourceClaims"] = [{"name": POD_CLAIM_REF, "resourceClaimName": claim}]
    if stage.placement.mode is PlacementMode.EXPLICIT:
        pod_spec["nodeName"] = stage.placement.node_name
    if tpl.node_selector:
        pod_spec["nodeSelector"] = dict(tpl.node_selector)
    if tpl.tolerations:
        pod_spec["tolerations"] = [copy.deepcopy(dict(t)) for t in tpl.tolerations]
    if tpl.service_account_name:
        pod_spec["serviceAccountName"] = tpl.service_account_name
    else:
        pod_spec["automountServiceAccountToken"] = False
    if tpl.priority_class_name:
        pod_spec["priorityClassName"] = tpl.priority_class_name
    return pod_spec


def build_service(stage: StageSpec, *, owner: Mapping[str, Any]) -> dict[str, Any]:
    """The stage's ClusterIP Service: ``grpc`` to the worker port, ``http`` to its OpenAI API."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": service_name(stage.name),
            "namespace": stage.namespace,
            "labels": stage_labels(stage.name, stage.group),
            "ownerReferences": [copy.deepcopy(dict(owner))],
        },
        "spec": {
            "type": "ClusterIP",
            "selector": stage_selector(stage.name),
            "ports": [
                {
                    "name": PORT_NAME,
                    "port": stage.worker.port,
                    "targetPort": stage.worker.port,
                    "protocol": "TCP",
                    "appProtocol": "grpc",
                },
                {
                    "name": HTTP_PORT_NAME,
                    "port": stage.worker.http_port,
                    "targetPort": stage.worker.http_port,
                    "protocol": "TCP",
                    "appProtocol": "http",
                },
            ],
        },
    }


def build_group_claim(
    namespace: str, group: str, gpus: int, device_class: str = DEFAULT_DEVICE_CLASS
) -> dict[str, Any]:
    """The group's shared DRA ResourceClaim for ``gpus`` devices (no owner: the operator
    deletes it when the group's last stage goes)."""
    if gpus < 1:
        raise ValueError(f"a group claim needs at least one GPU, got {gpus}")
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {
            "name": claim_name(group),
            "namespace": namespace,
            "labels": group_labels(group),
        },
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": POD_CLAIM_REF,
                        "exactly": {
                            "deviceClassName": device_class,
                            "allocationMode": "ExactCount",
                            "count": gpus,
                        },
                    }
                ]
            }
        },
    }
