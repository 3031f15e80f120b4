"""Write kubeconfig files and read one back into what an HTTP client needs."""

from __future__ import annotations

import base64
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml


@dataclass(frozen=True)
class KubeAuth:
    """Server address and credentials, as files an HTTP client can use."""

    server: str
    ca_file: Path
    cert_file: Path | None = None
    key_file: Path | None = None
    token: str | None = None


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def _config(
    server: str, ca: Path, user: dict[str, str], name: str, namespace: str | None = None
) -> dict[str, Any]:
    context = {"cluster": "omnistage", "user": name}
    if namespace:
        context["namespace"] = namespace
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "omnistage",
                "cluster": {"server": server, "certificate-authority-data": _b64(ca)},
            }
        ],
        "users": [{"name": name, "user": user}],
        "contexts": [{"name": name, "context": context}],
        "current-context": name,
    }


def write_cert_kubeconfig(
    path: Path, server: str, ca: Path, cert: Path, key: Path, *, name: str
) -> Path:
    """A self-contained kubeconfig authenticating with a client certificate."""
    user = {"client-certificate-data": _b64(cert), "client-key-data": _b64(key)}
    path.write_text(yaml.safe_dump(_config(server, ca, user, name)))
    path.chmod(0o600)
    return path


def write_token_kubeconfig(
    path: Path, server: str, ca: Path, token: str, name: str, *, namespace: str | None = None
) -> Path:
    """A self-contained kubeconfig authenticating with a bearer token (default ``namespace``)."""
    path.write_text(yaml.safe_dump(_config(server, ca, {"token": token}, name, namespace)))
    path.chmod(0o600)
    return path


def _materialize(entry: dict[str, Any], key: str, base: Path, scratch: Path) -> Path | None:
    if f"{key}-data" in entry:
        out = scratch / key
        out.write_bytes(base64.b64decode(entry[f"{key}-data"]))
        return out
    if key in entry:
        p = Path(entry[key])
        return p if p.is_absolute() else base / p
    return None


def load_kubeconfig(path: Path) -> KubeAuth:
    """Read the current context of ``path`` (embedded data is written to a private temp dir)."""
    cfg: dict[str, Any] = yaml.safe_load(path.read_text())
    ctx_name = cfg.get("current-context")
    contexts = {c["name"]: c["context"] for c in cfg.get("contexts", [])}
    if ctx_name not in contexts:
        raise ValueError(f"{path}: current-context {ctx_name!r} is not among its contexts")
    ctx = contexts[ctx_name]
    cluster = {c["name"]: c["cluster"] for c in cfg["clusters"]}[ctx["cluster"]]
    user = {u["name"]: u["user"] for u in cfg.get("users", [])}.get(ctx.get("user"), {})
    scratch = Path(tempfile.mkdtemp(prefix="kubeauth-"))
    ca = _materialize(cluster, "certificate-authority", path.parent, scratch)
    if ca is None:
        raise ValueError(f"{path}: cluster {ctx['cluster']!r} has no certificate-authority")
    return KubeAuth(
        server=str(cluster["server"]).rstrip("/"),
        ca_file=ca,
        cert_file=_materialize(user, "client-certificate", path.parent, scratch),
        key_file=_materialize(user, "client-key", path.parent, scratch),
        token=user.get("token"),
    )


def ssl_context(
    ca_file: Path, cert_file: Path | None = None, key_file: Path | None = None
) -> ssl.SSLContext:
    """A TLS context trusting ``ca_file`` and presenting the client certificate, if any."""
    ctx = ssl.create_default_context(cafile=str(ca_file))
    if cert_file and key_file:
        ctx.load_cert_chain(str(cert_file), str(key_file))
    return ctx


def auth_context(auth: KubeAuth) -> ssl.SSLContext:
    """The TLS context for ``auth``."""
    return ssl_context(auth.ca_file, auth.cert_file, auth.key_file)
