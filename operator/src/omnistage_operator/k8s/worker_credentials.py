"""What the operator presents to workers: the shared bearer token (copied into every stage
namespace as a Secret) or a Kubernetes-issued ServiceAccount token with the audience
``omnistage-worker`` (no Secret; each worker reviews it with a TokenReview).

A :class:`ProjectedToken` reads the token from a file the kubelet rotates (a projected
``serviceAccountToken`` volume; for a local run, ``kubectl create token --audience`` written to a
file), re-reading it when the file changes, and names the operator's identity from the token's
own ``sub`` claim, so the workers' ``--operator-identity`` always matches who presents it.
"""

from __future__ import annotations

import base64
import json
import os
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "DEFAULT_AUDIENCE",
    "WORKER_SERVICE_ACCOUNT",
    "CredentialsError",
    "ProjectedToken",
    "SharedToken",
    "WorkerCredentials",
    "for_token_review",
    "token_subject",
]

DEFAULT_AUDIENCE = "omnistage-worker"


class CredentialsError(ValueError):
    """The operator's worker credentials are unusable (the message names the flag or file)."""


def token_subject(token: str) -> str:
    """The ``sub`` claim of a JWT (not verified: it is the operator's own token)."""
    parts = token.split(".")
    if len(parts) != 3:
        raise CredentialsError("the worker identity token is not a JWT")
    body = parts[1] + "=" * (-len(parts[1]) % 4)
    try:
        claims = json.loads(base64.urlsafe_b64decode(body))
    except (ValueError, TypeError) as exc:
        raise CredentialsError(f"the worker identity token's claims are unreadable: {exc}") from exc
    sub = claims.get("sub") if isinstance(claims, dict) else None
    if not isinstance(sub, str) or not sub.startswith("system:serviceaccount:"):
        raise CredentialsError(f"the worker identity token's subject is {sub!r}, not a SA")
    return sub


@dataclass(frozen=True)
class SharedToken:
    """The shared bearer token mode (``--worker-token-file``)."""

    token: str | None

    def current(self) -> str | None:
        return self.token

    def adapt(self, pod: dict[str, Any]) -> dict[str, Any]:
        """The worker Pod as built (it mounts the shared token's Secret)."""
        return pod

    def pod_flags(self) -> tuple[str, ...]:
        """What this mode adds to every worker pod's command (none: the Secret is mounted)."""
        return ()

    @property
    def shared(self) -> str | None:
        """The token to copy into each stage namespace's Secret."""
        return self.token


@dataclass
class ProjectedToken:
    """A Kubernetes-issued token read from ``path`` (``--worker-identity-token-file``)."""

    path: str
    audience: str = DEFAULT_AUDIENCE
    _token: str = field(default="", repr=False)
    _stamp: tuple[int, int] = (-1, -1)

    def current(self) -> str:
        """The token now in the file (read again only when its mtime or size changed)."""
        try:
            st = os.stat(self.path)
            stamp = (st.st_mtime_ns, st.st_size)
            if stamp != self._stamp:
                with open(self.path, encoding="utf-8") as f:
                    token = f.read().strip()
                if not token:
                    raise CredentialsError(f"--worker-identity-token-file {self.path} is empty")
                self._token, self._stamp = token, stamp
        except OSError as exc:
            if not self._token:
                raise CredentialsError(f"--worker-identity-token-file: {exc}") from exc
        return self._token

    @property
    def identity(self) -> str:
        """``system:serviceaccount:<ns>:<name>`` of the token now presented."""
        return token_subject(self.current())

    def worker_args(self) -> list[str]:
        """The worker flags that make it accept this operator's tokens only."""
        return ["--operator-identity", self.identity, "--token-audience", self.audience]

    def adapt(self, pod: dict[str, Any]) -> dict[str, Any]:
        """The worker Pod accepting this operator's Kubernetes-issued tokens only."""
        return for_token_review(pod, self.worker_args())

    def pod_flags(self) -> tuple[str, ...]:
        """What this mode adds to every worker pod's command."""
        return tuple(self.worker_args())

    @property
    def shared(self) -> None:
        """No shared token: nothing is copied into stage namespaces."""
        return None


WorkerCredentials = SharedToken | ProjectedToken

# The stage pods' ServiceAccount with Kubernetes-issued credentials (the chart creates it in each
# served namespace and lets it create TokenReviews), unless spec.template.serviceAccountName.
WORKER_SERVICE_ACCOUNT = "omnistage-worker"


def for_token_review(
    pod: dict[str, Any], worker_args: list[str], token_flag: str = "--token-file"
) -> dict[str, Any]:
    """``pod`` (a built worker Pod, changed in place and returned) without the shared token:
    ``token_flag`` and its value become ``worker_args``, the token volume and mount go, and the
    pod mounts its ServiceAccount's token (the worker's TokenReviews need it)."""
    spec = pod["spec"]
    container = spec["containers"][0]
    args: list[str] = container["args"]
    at = args.index(token_flag)
    token_dir = os.path.dirname(args[at + 1])
    container["args"] = [*args[:at], *worker_args, *args[at + 2 :]]
    mounts = container.get("volumeMounts") or []
    gone = {m["name"] for m in mounts if m.get("mountPath") == token_dir}
    container["volumeMounts"] = [m for m in mounts if m["name"] not in gone]
    spec["volumes"] = [v for v in spec.get("volumes") or [] if v["name"] not in gone]
    spec.setdefault("serviceAccountName", WORKER_SERVICE_ACCOUNT)
    spec["automountServiceAccountToken"] = True
    return pod
