"""The chart's NetworkPolicies: who reaches the workers' control channel and their HTTP API."""

from __future__ import annotations

from tests.unit.test_chart_support import (
    NAMESPACE,
    RELEASE,
    Obj,
    one,
    render,
    select,
)


def _policy_ingress(policy: Obj) -> Obj:
    """The control-channel rule (gRPC from the operator), always the first."""
    ingress: list[Obj] = policy["spec"]["ingress"]
    return ingress[0]


def _http_rule(policy: Obj) -> Obj:
    """The OpenAI HTTP rule, the second."""
    ingress: list[Obj] = policy["spec"]["ingress"]
    assert len(ingress) == 2, ingress
    return ingress[1]


def test_network_policy_admits_only_the_operator_pods() -> None:
    objs = render()
    policy = one(objs, "NetworkPolicy")
    assert policy["metadata"]["namespace"] == NAMESPACE
    assert policy["spec"]["podSelector"] == {
        "matchLabels": {"app.kubernetes.io/name": "omnistage-worker"}
    }
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    rule = _policy_ingress(policy)
    assert rule["ports"] == [{"protocol": "TCP", "port": 50051}]
    (peer,) = rule["from"]
    assert peer["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": NAMESPACE}}
    # The peer's pod selector must select the operator pod and nothing broader.
    pod_labels = one(objs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    selector = peer["podSelector"]["matchLabels"]
    assert selector.items() <= pod_labels.items()
    assert selector["app.kubernetes.io/instance"] == RELEASE
    assert selector["app.kubernetes.io/component"] == "operator"


def test_network_policy_admits_http_from_the_stage_namespace_by_default() -> None:
    policy = one(render(), "NetworkPolicy")
    rule = _http_rule(policy)
    assert rule["ports"] == [{"protocol": "TCP", "port": 8000}]
    # Every pod of the policy's own namespace (a podSelector without a namespaceSelector).
    assert rule["from"] == [{"podSelector": {}}]


def test_network_policy_admits_the_routers_on_their_worker_ports() -> None:
    values = {
        "networkPolicy": {"namespaces": ["models"], "httpFromSameNamespace": False},
        "router": {
            "enabled": True,
            "groups": [
                {"name": "studio", "stages": ["a"], "namespace": "models", "workerPort": 8001}
            ],
        },
    }
    objs = render(values)
    policy = one(objs, "NetworkPolicy")
    rule = _http_rule(policy)
    assert sorted(p["port"] for p in rule["ports"]) == [8000, 8001]
    (peer,) = rule["from"]
    assert peer["namespaceSelector"]["matchExpressions"] == [
        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["models"]}
    ]
    # The peer selects the router pods and not the operator's.
    router = next(o for o in select(objs, "Deployment") if "router" in o["metadata"]["name"])
    router_labels = router["spec"]["template"]["metadata"]["labels"]
    selector = peer["podSelector"]["matchLabels"]
    assert selector.items() <= router_labels.items()
    operator_labels = one([o for o in select(objs, "Deployment") if o is not router], "Deployment")[
        "spec"
    ]["template"]["metadata"]["labels"]
    assert not selector.items() <= operator_labels.items()


def test_network_policy_http_closed_without_clients() -> None:
    values = {"networkPolicy": {"httpFromSameNamespace": False}}
    policy = one(render(values), "NetworkPolicy")
    assert len(policy["spec"]["ingress"]) == 1


def test_network_policy_http_sources() -> None:
    apps = {"namespaceSelector": {"matchLabels": {"team": "apps"}}}
    values = {"networkPolicy": {"httpFromSameNamespace": False, "httpIngressFrom": [apps]}}
    policy = one(render(values), "NetworkPolicy")
    assert _http_rule(policy)["from"] == [apps]
    # HTTP sources do not reach the control channel.
    assert apps not in _policy_ingress(policy)["from"]


def test_network_policy_per_served_namespace_with_extra_sources() -> None:
    gateway = {"podSelector": {"matchLabels": {"app": "gateway"}}}
    values = {
        "watch": {"namespaces": ["team-a", "team-b"]},
        "networkPolicy": {"workerPorts": [50051, 50052], "extraIngressFrom": [gateway]},
    }
    policies = select(render(values), "NetworkPolicy")
    assert sorted(p["metadata"]["namespace"] for p in policies) == ["team-a", "team-b"]
    for policy in policies:
        rule = _policy_ingress(policy)
        assert rule["from"][1:] == [gateway]
        assert [p["port"] for p in rule["ports"]] == [50051, 50052]
        # Inference clients reach the HTTP API too.
        assert gateway in _http_rule(policy)["from"]


def test_network_policy_namespaces_override() -> None:
    values = {"networkPolicy": {"namespaces": ["models"]}}
    policies = select(render(values), "NetworkPolicy")
    assert [p["metadata"]["namespace"] for p in policies] == ["models"]


def test_network_policy_off() -> None:
    assert select(render({"networkPolicy": {"enabled": False}}), "NetworkPolicy") == []
