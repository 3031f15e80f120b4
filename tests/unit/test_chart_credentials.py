"""The chart's workerCredentials modes: the shared token Secret, or Kubernetes-issued tokens."""

from __future__ import annotations

from typing import Any

from tests.unit.test_chart_support import one, render, render_error, select

KUBE: dict[str, Any] = {
    "workerCredentials": {"mode": "kubernetes"},
    "watch": {"namespaces": ["team-a", "team-b"]},
}


def _operator(objs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    pod = one(objs, "Deployment")["spec"]["template"]["spec"]
    return pod, pod["containers"][0]


def test_shared_is_the_default() -> None:
    objs = render()
    _, container = _operator(objs)
    assert "--worker-token-file=/var/run/secrets/omnistage/token" in container["args"]
    assert not any(a.startswith("--worker-identity-token-file") for a in container["args"])
    assert any(s["metadata"]["name"].endswith("worker-token") for s in select(objs, "Secret"))
    assert not [o for o in objs if o["metadata"]["name"].endswith("worker-tokenreview")]


def test_kubernetes_mode() -> None:
    objs = render(KUBE)
    pod, container = _operator(objs)
    assert (
        "--worker-identity-token-file=/var/run/secrets/omnistage-identity/token"
        in (container["args"])
    )
    assert "--worker-token-audience=omnistage-worker" in container["args"]
    assert not any(a.startswith("--worker-token-file") for a in container["args"])
    (volume,) = [v for v in pod["volumes"] if v["name"] == "worker-identity"]
    assert volume["projected"]["sources"] == [
        {
            "serviceAccountToken": {
                "path": "token",
                "audience": "omnistage-worker",
                "expirationSeconds": 3600,
            }
        }
    ]
    assert "worker-token" not in {v["name"] for v in pod["volumes"]}
    assert not any(s["metadata"]["name"].endswith("worker-token") for s in select(objs, "Secret"))
    role = [o for o in select(objs, "ClusterRole") if o["metadata"]["name"].endswith("tokenreview")]
    assert role[0]["rules"] == [
        {
            "apiGroups": ["authentication.k8s.io"],
            "resources": ["tokenreviews"],
            "verbs": ["create"],
        }
    ]
    binding = [
        o
        for o in select(objs, "ClusterRoleBinding")
        if o["metadata"]["name"].endswith("tokenreview")
    ]
    assert binding[0]["subjects"] == [
        {"kind": "ServiceAccount", "name": "omnistage-worker", "namespace": ns}
        for ns in ("team-a", "team-b")
    ]
    workers = [
        o for o in select(objs, "ServiceAccount") if o["metadata"]["name"] == "omnistage-worker"
    ]
    assert sorted(o["metadata"]["namespace"] for o in workers) == ["team-a", "team-b"]


def test_bad_values_are_refused_naming_the_key() -> None:
    assert "watch.namespaces" in render_error({"workerCredentials": {"mode": "kubernetes"}})
    assert "workerCredentials" in render_error({"workerCredentials": {"mode": "secret"}})
    low = {**KUBE, "workerCredentials": {"mode": "kubernetes", "expirationSeconds": 60}}
    assert "expirationSeconds" in render_error(low)
