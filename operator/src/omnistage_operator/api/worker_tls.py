"""``spec.worker.tls``: the worker's control channel over TLS, its probes over plaintext.

``spec.worker.tls.secretName`` names a ``kubernetes.io/tls`` Secret in the stage's namespace
(``tls.crt``, ``tls.key``; what a cert-manager ``Certificate`` writes), whose certificate names
the stage's Service, ``<stage>-worker.<namespace>.svc``: the operator dials pod IPs and
verifies that name. The Secret is mounted read-only and passed as ``--tls-cert``/``--tls-key``,
so SleepService, DemandService and InferenceService answer TLS only. The kubelet's gRPC probe
cannot speak TLS, so the worker also serves grpc.health.v1, and nothing else, in plaintext on
``spec.worker.healthPort`` (``--health-port``, default 50052), where the pod's probes point.

Without ``tls`` nothing changes: one plaintext port, probed there. Pure logic, no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

__all__ = [
    "DEFAULT_HEALTH_PORT",
    "HEALTH_PORT_NAME",
    "TLS_ARGS",
    "TLS_MOUNT_DIR",
    "TLS_VOLUME",
    "WorkerTls",
    "WorkerTlsError",
    "parse_worker_tls",
    "probe_port",
    "tls_args",
    "tls_volume",
]

DEFAULT_HEALTH_PORT: Final = 50052
HEALTH_PORT_NAME: Final = "health"
TLS_VOLUME: Final = "omnistage-tls"
TLS_MOUNT_DIR: Final = "/var/run/secrets/omnistage-tls"
# The worker flags these set; spec.worker.args may not set them.
TLS_ARGS: Final = frozenset({"--tls-cert", "--tls-key", "--health-port"})
_SECRET_NAME: Final = re.compile(
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
)


class WorkerTlsError(ValueError):
    """An invalid ``spec.worker.tls`` or ``spec.worker.healthPort``; ``field`` is its path."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class WorkerTls:
    """``secret_name`` None: plaintext (the default)."""

    secret_name: str | None = None
    health_port: int = DEFAULT_HEALTH_PORT

    @property
    def enabled(self) -> bool:
        """Whether the worker serves its control channel with TLS."""
        return self.secret_name is not None


def parse_worker_tls(worker: Mapping[str, Any]) -> WorkerTls:
    """``spec.worker.tls`` and ``spec.worker.healthPort`` of a ``spec.worker`` mapping."""
    port = worker.get("healthPort", DEFAULT_HEALTH_PORT)
    if isinstance(port, bool) or not isinstance(port, int) or not 1024 <= port <= 65535:
        raise WorkerTlsError("spec.worker.healthPort", f"must be a port 1024-65535, got {port!r}")
    tls = worker.get("tls")
    if tls is None:
        return WorkerTls(health_port=port)
    if not isinstance(tls, Mapping):
        raise WorkerTlsError("spec.worker.tls", "must be an object")
    name = tls.get("secretName")
    if not isinstance(name, str) or not _SECRET_NAME.match(name):
        raise WorkerTlsError("spec.worker.tls.secretName", f"must be a Secret's name, got {name!r}")
    return WorkerTls(secret_name=name, health_port=port)


def tls_args(tls: WorkerTls) -> list[str]:
    """The worker's TLS and health-port flags (none without TLS)."""
    if not tls.enabled:
        return []
    return [
        "--tls-cert",
        f"{TLS_MOUNT_DIR}/tls.crt",
        "--tls-key",
        f"{TLS_MOUNT_DIR}/tls.key",
        "--health-port",
        str(tls.health_port),
    ]


def tls_volume(tls: WorkerTls) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The worker's mount and the pod's volume for the certificate Secret (None without TLS)."""
    if tls.secret_name is None:
        return None
    mount = {"name": TLS_VOLUME, "mountPath": TLS_MOUNT_DIR, "readOnly": True}
    volume = {
        "name": TLS_VOLUME,
        "secret": {
            "secretName": tls.secret_name,
            "items": [{"key": "tls.crt", "path": "tls.crt"}, {"key": "tls.key", "path": "tls.key"}],
            "defaultMode": 0o400,
        },
    }
    return mount, volume


def probe_port(tls: WorkerTls, grpc_port: int) -> int:
    """Where the kubelet's gRPC probes go: the plaintext health port with TLS, else gRPC's."""
    return tls.health_port if tls.enabled else grpc_port
