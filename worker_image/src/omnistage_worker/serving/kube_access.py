"""Where the worker reaches the API server for its TokenReviews outside the in-cluster layout:
the current context of ``$KUBECONFIG`` (server, bearer token, CA), as Kubernetes clients fall
back to it. Only token users are supported (the worker reviews with its ServiceAccount)."""

from __future__ import annotations

import base64
import tempfile
from pathlib import Path
from typing import Any

import yaml

__all__ = ["KubeconfigError", "access_from_kubeconfig"]


class KubeconfigError(ValueError):
    """The kubeconfig cannot be used (the message says why)."""


def _named(entries: Any, name: str, what: str) -> dict[str, Any]:
    for entry in entries or []:
        if entry.get("name") == name:
            return dict(entry.get(what) or {})
    raise KubeconfigError(f"kubeconfig: no {what} named {name!r}")


def access_from_kubeconfig(path: Path) -> tuple[str, Path, Path | None]:
    """``(server, token_file, ca_file)`` of the current context; inline token and CA data are
    written to a private temporary directory."""
    try:
        config = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise KubeconfigError(f"kubeconfig {path}: {exc}") from exc
    context = _named(config.get("contexts"), str(config.get("current-context")), "context")
    cluster = _named(config.get("clusters"), str(context.get("cluster")), "cluster")
    user = _named(config.get("users"), str(context.get("user")), "user")
    scratch = Path(tempfile.mkdtemp(prefix="omnistage-kube-"))
    if user.get("tokenFile"):
        token_file = Path(user["tokenFile"])
    elif user.get("token"):
        token_file = scratch / "token"
        token_file.write_text(user["token"])
    else:
        raise KubeconfigError(f"kubeconfig {path}: the current user has no token")
    ca_file: Path | None = None
    if cluster.get("certificate-authority-data"):
        ca_file = scratch / "ca.crt"
        ca_file.write_bytes(base64.b64decode(cluster["certificate-authority-data"]))
    elif cluster.get("certificate-authority"):
        ca_file = Path(cluster["certificate-authority"])
    server = cluster.get("server")
    if not server:
        raise KubeconfigError(f"kubeconfig {path}: the current cluster has no server")
    return str(server), token_file, ca_file
