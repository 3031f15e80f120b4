"""The operator's kopf login: the Service's address from the kubelet's environment."""

from __future__ import annotations

from omnistage_operator.runtime.login import in_cluster_server


def test_in_cluster_server_from_the_kubelets_variables() -> None:
    env = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    assert in_cluster_server(env) == "https://10.0.0.1:443"
    v6 = {"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "6443"}
    assert in_cluster_server(v6) == "https://[fd00::1]:6443"
    assert in_cluster_server({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}) is None
    assert in_cluster_server({}) is None
