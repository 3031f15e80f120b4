"""Who may order a worker with Kubernetes-issued tokens (``--operator-identity``) and how the
worker asks the API server (TokenReview): the settings, checked when made; the review itself is
:mod:`omnistage_worker.serving.token_review`. Pure: no I/O."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["DEFAULT_AUDIENCE", "SA_DIR", "TokenReviewSettings"]

DEFAULT_AUDIENCE = "omnistage-worker"
SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


@dataclass(frozen=True)
class TokenReviewSettings:
    """Who may order this worker and how to ask the API server.

    ``operator_identity``: ``system:serviceaccount:<ns>:<name>``; ``server``: the API server's
    URL; ``token_file``/``ca_file``: the worker's own ServiceAccount token (re-read on every
    review: the kubelet rotates it) and the cluster CA."""

    operator_identity: str
    audience: str = DEFAULT_AUDIENCE
    server: str = ""
    token_file: Path = SA_DIR / "token"
    ca_file: Path | None = SA_DIR / "ca.crt"
    cache_ttl_s: float = 10.0
    cache_size: int = 256
    timeout_s: float = 5.0

    def __post_init__(self) -> None:
        parts = self.operator_identity.split(":")
        if len(parts) != 4 or parts[:2] != ["system", "serviceaccount"] or not all(parts[2:]):
            raise ValueError(
                "--operator-identity: expected system:serviceaccount:<namespace>:<name>, "
                f"got {self.operator_identity!r}"
            )
        if not self.audience:
            raise ValueError("--token-audience: must not be empty")
        if not self.server:
            raise ValueError(
                "--kube-server: no API server (outside a pod give the URL; in a pod the kubelet "
                "sets KUBERNETES_SERVICE_HOST/PORT)"
            )
        if self.cache_ttl_s < 0 or self.cache_size < 1:
            raise ValueError("token review cache: TTL must be >= 0 and size >= 1")
