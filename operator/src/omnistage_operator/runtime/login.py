"""kopf's login: a kubeconfig, or in a pod the service account at the ``kubernetes`` Service's
address from the environment the kubelet sets, as client-go and kr8s connect.

kopf's own service-account login names ``https://kubernetes.default.svc``, which needs the
cluster's DNS; the kubelet's ``KUBERNETES_SERVICE_HOST``/``KUBERNETES_SERVICE_PORT`` need none,
so kopf and the operator's kr8s client reach the API server the same way. Registering these
handlers replaces kopf's fallback logins (it uses those only when no login handler exists).

Each login gives kopf its session over a connector with a bounded number of connections
(``kopf_session``; the bound is set by :func:`configure` from the namespaces served).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
from collections.abc import Mapping
from typing import Any

import kopf

from omnistage_operator.k8s.kopf_session import bounded_session, connection_limit

__all__ = ["configure", "in_cluster_server"]


class _Limit:
    connections = connection_limit(())


def configure(namespaces: tuple[str, ...]) -> None:
    """Bound kopf's connections for an operator serving ``namespaces`` (empty: all)."""
    _Limit.connections = connection_limit(namespaces)


def in_cluster_server(env: Mapping[str, str]) -> str | None:
    """``https://host:port`` of the ``kubernetes`` Service from the kubelet's variables, or
    None outside a pod (an IPv6 host is bracketed)."""
    host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT")
    if not host or not port:
        return None
    try:
        if ipaddress.ip_address(host).version == 6:
            host = f"[{host}]"
    except ValueError:
        pass  # a name
    return f"https://{host}:{port}"


def _session(info: kopf.ConnectionInfo | None) -> kopf.AiohttpSession | None:
    return None if info is None else bounded_session(info, _Limit.connections)


# Coroutines: the session they build belongs to kopf's event loop.
@kopf.on.login(id="kubeconfig", errors=kopf.ErrorsMode.IGNORED)
async def login_with_kubeconfig(**kwargs: Any) -> kopf.AiohttpSession | None:
    """``$KUBECONFIG`` or ``~/.kube/config``, as kopf's own fallback reads them."""
    return _session(kopf.login_with_kubeconfig(**kwargs))


@kopf.on.login(id="service-account", errors=kopf.ErrorsMode.IGNORED)
async def login_with_service_account(**kwargs: Any) -> kopf.AiohttpSession | None:
    """The pod's service-account token and CA, at the Service's address when the kubelet
    gave it."""
    info = kopf.login_with_service_account(**kwargs)
    server = in_cluster_server(os.environ)
    if info is not None and server is not None:
        info = dataclasses.replace(info, server=server)
    return _session(info)
