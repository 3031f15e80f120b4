"""The chart's router serves pipelines: ``--pipeline`` flags, the stages' gRPC port, and the
NetworkPolicy admitting those routers on the workers' gRPC ports; the chart ships the
OmniPipeline CRD beside OmniStage's."""

from __future__ import annotations

from pathlib import Path

import yaml

from tests.e2e.test_helm_support import crd_template_text
from tests.unit.test_chart_support import CHART_DIR, one, render, render_error, select

ROOT = Path(__file__).resolve().parents[2]
GROUP = {
    "name": "studio",
    "stages": ["qwen-encoder", "qwen-dit"],
    "namespace": "models",
    "pipelines": ["qwen-image=qwen-encoder:embeds,qwen-dit"],
}


def test_router_serves_the_group_pipelines() -> None:
    objs = render({"router": {"enabled": True, "groups": [GROUP]}})
    router = next(o for o in select(objs, "Deployment") if "-router-" in o["metadata"]["name"])
    (container,) = router["spec"]["template"]["spec"]["containers"]
    assert container["args"][-2:] == [
        "--worker-grpc-port=50051",
        "--pipeline=qwen-image=qwen-encoder:embeds,qwen-dit",
    ]
    plain = render({"router": {"enabled": True, "groups": [{**GROUP, "pipelines": []}]}})
    plain_router = next(
        o for o in select(plain, "Deployment") if "-router-" in o["metadata"]["name"]
    )
    args = plain_router["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not [a for a in args if a.startswith(("--pipeline", "--worker-grpc-port"))]
    for bad in ("qwen-image", "p=a,b", "p=a:pickle,b", "p=a:embeds"):
        refused = render_error(
            {"router": {"enabled": True, "groups": [{**GROUP, "pipelines": [bad]}]}}
        )
        assert "pipelines" in refused, refused


def test_network_policy_admits_pipeline_routers_on_the_grpc_ports() -> None:
    values = {
        "networkPolicy": {"namespaces": ["models"], "httpFromSameNamespace": False},
        "router": {"enabled": True, "groups": [GROUP]},
    }
    policy = one(render(values), "NetworkPolicy")
    grpc_rule = policy["spec"]["ingress"][0]
    assert [p["port"] for p in grpc_rule["ports"]] == [50051]
    routers = [
        peer
        for peer in grpc_rule["from"]
        if peer.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/component")
        == "router"
    ]
    assert len(routers) == 1
    assert routers[0]["namespaceSelector"]["matchExpressions"][0]["values"] == ["models"]
    without = {**values, "router": {"enabled": True, "groups": [{**GROUP, "pipelines": []}]}}
    grpc_from = one(render(without), "NetworkPolicy")["spec"]["ingress"][0]["from"]
    assert not [p for p in grpc_from if "router" in str(p)]


def test_chart_templates_the_pipeline_crd_like_omnistage() -> None:
    source_path = ROOT / "crds" / "omnipipelines.omnistage.io.yaml"
    template = CHART_DIR / "templates" / "crds" / source_path.name
    assert template.read_text() == crd_template_text(source_path), "run `make generate`"
    crds = {c["metadata"]["name"]: c for c in select(render(), "CustomResourceDefinition")}
    source = yaml.safe_load(source_path.read_text())
    crd = crds["omnipipelines.omnistage.io"]
    assert crd["spec"] == source["spec"]
    assert crd["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    assert select(render({"crds": {"enabled": False}}), "CustomResourceDefinition") == []
