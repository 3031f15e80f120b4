"""The worker pod's adaptable fields under ``spec.template`` (pure parsing and merging).

``spec.template`` fields beside the older ones (resources, env, volumes, ...; see spec.py):

- ``securityContext`` (core PodSecurityContext) and ``containerSecurityContext`` (the worker
  container's SecurityContext): merged key by key over a default that the ``restricted`` Pod
  Security Standard admits (non-root, RuntimeDefault seccomp, no privilege escalation, every
  capability dropped; ``fsGroup`` the worker image's group); a key the user gives wins, so
  ``runAsNonRoot: false`` is an explicit choice.
- ``imagePullSecrets`` (names), ``affinity``, ``topologySpreadConstraints``,
  ``runtimeClassName``: copied into the pod spec.
- ``envFrom`` (ConfigMap or Secret sources) on the worker container. Kubernetes lets ``env``
  override ``envFrom``, so the operator's own variables always win over a source's.
- ``initContainers``: run before the worker (the name ``worker`` and the operator's reserved
  init container names are refused by the CRD).
- ``shmSize``: a memory-backed ``emptyDir`` of that size mounted at ``/dev/shm`` (vLLM with
  tensor parallelism and torch data loaders need more than the runtime's 64 MiB default).

The CRD validates each field's shape; ``parse_pod_extras`` reads a stored body into a
``PodExtras`` (raising ``PodTemplateError`` naming the field for what cannot be read) and
``apply_pod_extras`` writes it into a built pod spec and worker container.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from omnistage_worker.quantities import QuantityError, parse_quantity

__all__ = [
    "DEFAULT_CONTAINER_SECURITY_CONTEXT",
    "DEFAULT_POD_SECURITY_CONTEXT",
    "RESERVED_INIT_CONTAINERS",
    "SHM_MOUNT_PATH",
    "SHM_VOLUME",
    "PodExtras",
    "PodTemplateError",
    "apply_pod_extras",
    "hash_payload",
    "parse_pod_extras",
]

# fsGroup: the worker image's group (USER 65532:65532). The kubelet gives the pod's Secret
# volumes to it, so the worker (non-root) can read its token and TLS key (mode 0400 otherwise
# leaves them root's alone). OnRootMismatch: a model PVC already owned so is not walked again
# at every pod start.
WORKER_GROUP: Final = 65532
DEFAULT_POD_SECURITY_CONTEXT: Final[Mapping[str, Any]] = {
    "runAsNonRoot": True,
    "seccompProfile": {"type": "RuntimeDefault"},
    "fsGroup": WORKER_GROUP,
    "fsGroupChangePolicy": "OnRootMismatch",
}
DEFAULT_CONTAINER_SECURITY_CONTEXT: Final[Mapping[str, Any]] = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
}
SHM_VOLUME: Final = "omnistage-shm"
SHM_MOUNT_PATH: Final = "/dev/shm"
# Init container names the operator keeps for itself (the worker container's name too).
RESERVED_INIT_CONTAINERS: Final = frozenset({"worker", "omnistage-model"})
_PATH: Final = "spec.template"


class PodTemplateError(ValueError):
    """An unreadable ``spec.template`` field; ``field`` is its dotted path."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class PodExtras:
    """The adaptable pod fields (copies of the body; empty means "not given")."""

    security_context: Mapping[str, Any] = field(default_factory=dict, hash=False)
    container_security_context: Mapping[str, Any] = field(default_factory=dict, hash=False)
    image_pull_secrets: tuple[str, ...] = ()
    affinity: Mapping[str, Any] = field(default_factory=dict, hash=False)
    topology_spread_constraints: tuple[Mapping[str, Any], ...] = field(default=(), hash=False)
    runtime_class_name: str | None = None
    env_from: tuple[Mapping[str, Any], ...] = field(default=(), hash=False)
    init_containers: tuple[Mapping[str, Any], ...] = field(default=(), hash=False)
    shm_size: str | None = None


def _object(value: Any, path: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise PodTemplateError(path, f"must be an object, got {type(value).__name__}")
    return copy.deepcopy(dict(value))


def _objects(value: Any, path: str) -> tuple[dict[str, Any], ...]:
    if value is None:
        return ()
    if not isinstance(value, Sequence) or isinstance(value, str):
        raise PodTemplateError(path, "must be a list")
    return tuple(_object(item, f"{path}[{i}]") for i, item in enumerate(value))


def _pull_secrets(value: Any) -> tuple[str, ...]:
    path = f"{_PATH}.imagePullSecrets"
    names: list[str] = []
    for i, item in enumerate(_objects(value, path)):
        name = item.get("name")
        if not isinstance(name, str) or not name:
            raise PodTemplateError(f"{path}[{i}].name", "is required (a Secret's name)")
        names.append(name)
    return tuple(names)


def _init_containers(value: Any) -> tuple[dict[str, Any], ...]:
    path = f"{_PATH}.initContainers"
    containers = _objects(value, path)
    for i, container in enumerate(containers):
        if container.get("name") in RESERVED_INIT_CONTAINERS:
            raise PodTemplateError(
                f"{path}[{i}].name", f"{container['name']!r} is used by the operator"
            )
    return containers


def _shm_size(value: Any) -> str | None:
    if value is None:
        return None
    try:
        size = parse_quantity(value)
    except QuantityError as exc:
        raise PodTemplateError(f"{_PATH}.shmSize", str(exc)) from None
    if size <= 0:
        raise PodTemplateError(f"{_PATH}.shmSize", f"must be positive, got {value!r}")
    return str(value)


def parse_pod_extras(template: Mapping[str, Any]) -> PodExtras:
    """The adaptable fields of a ``spec.template`` mapping."""
    runtime_class = template.get("runtimeClassName")
    if runtime_class is not None and not isinstance(runtime_class, str):
        raise PodTemplateError(f"{_PATH}.runtimeClassName", "must be a string")
    shm_size = _shm_size(template.get("shmSize"))
    if shm_size is not None:
        for i, mount in enumerate(_objects(template.get("volumeMounts"), f"{_PATH}.volumeMounts")):
            if str(mount.get("mountPath", "")).rstrip("/") == SHM_MOUNT_PATH:
                raise PodTemplateError(
                    f"{_PATH}.volumeMounts[{i}].mountPath",
                    f"{SHM_MOUNT_PATH} is mounted by the operator when shmSize is set",
                )
    return PodExtras(
        security_context=_object(template.get("securityContext"), f"{_PATH}.securityContext"),
        container_security_context=_object(
            template.get("containerSecurityContext"), f"{_PATH}.containerSecurityContext"
        ),
        image_pull_secrets=_pull_secrets(template.get("imagePullSecrets")),
        affinity=_object(template.get("affinity"), f"{_PATH}.affinity"),
        topology_spread_constraints=_objects(
            template.get("topologySpreadConstraints"), f"{_PATH}.topologySpreadConstraints"
        ),
        runtime_class_name=runtime_class or None,
        env_from=_objects(template.get("envFrom"), f"{_PATH}.envFrom"),
        init_containers=_init_containers(template.get("initContainers")),
        shm_size=shm_size,
    )


def _merged(default: Mapping[str, Any], given: Mapping[str, Any]) -> dict[str, Any]:
    """``given`` over ``default``, key by key (a given key replaces the default's value)."""
    return {**copy.deepcopy(dict(default)), **copy.deepcopy(dict(given))}


def apply_pod_extras(
    extras: PodExtras, pod_spec: dict[str, Any], container: dict[str, Any]
) -> None:
    """Write ``extras`` (and the restricted-compatible defaults) into a built pod spec and its
    worker container, in place."""
    pod_spec["securityContext"] = _merged(DEFAULT_POD_SECURITY_CONTEXT, extras.security_context)
    container["securityContext"] = _merged(
        DEFAULT_CONTAINER_SECURITY_CONTEXT, extras.container_security_context
    )
    if extras.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": n} for n in extras.image_pull_secrets]
    if extras.affinity:
        pod_spec["affinity"] = copy.deepcopy(dict(extras.affinity))
    if extras.topology_spread_constraints:
        pod_spec["topologySpreadConstraints"] = [
            copy.deepcopy(dict(c)) for c in extras.topology_spread_constraints
        ]
    if extras.runtime_class_name:
        pod_spec["runtimeClassName"] = extras.runtime_class_name
    if extras.env_from:
        container["envFrom"] = [copy.deepcopy(dict(s)) for s in extras.env_from]
    if extras.init_containers:
        pod_spec["initContainers"] = [copy.deepcopy(dict(c)) for c in extras.init_containers]
    if extras.shm_size is not None:
        pod_spec.setdefault("volumes", []).append(
            {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": extras.shm_size}}
        )
        container.setdefault("volumeMounts", []).append(
            {"name": SHM_VOLUME, "mountPath": SHM_MOUNT_PATH}
        )


def hash_payload(extras: PodExtras) -> list[object] | None:
    """What ``pod_spec_hash`` covers of ``extras``; None when nothing is given (so the pods of
    specs without these fields keep their hash, and are not replaced on an operator upgrade)."""
    if extras == PodExtras():
        return None
    return [
        extras.security_context,
        extras.container_security_context,
        extras.image_pull_secrets,
        extras.affinity,
        extras.topology_spread_constraints,
        extras.runtime_class_name,
        extras.env_from,
        extras.init_containers,
        extras.shm_size,
    ]
