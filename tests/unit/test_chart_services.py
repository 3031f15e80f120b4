"""The chart's Services: the operator's metrics Service and ServiceMonitor, the per-group router,
and the chart labels on every object."""

from __future__ import annotations

from tests.unit.test_chart_support import (
    NAMESPACE,
    PEERING_APIS,
    RELEASE,
    one,
    render,
    render_error,
    select,
)


def test_metrics_service_selects_the_operator_pod() -> None:
    objs = render()
    service = one(objs, "Service")
    assert service["spec"]["type"] == "ClusterIP"
    assert service["spec"]["ports"] == [
        {"name": "http-metrics", "port": 8080, "targetPort": "http-metrics", "protocol": "TCP"}
    ]
    pod_labels = one(objs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert select(objs, "ServiceMonitor") == [], "ServiceMonitor is off by default"


def test_service_monitor_on() -> None:
    values = {
        "metrics": {
            "serviceMonitor": {
                "enabled": True,
                "interval": "15s",
                "scrapeTimeout": "5s",
                "labels": {"release": "prom"},
            }
        }
    }
    objs = render(values)
    monitor = one(objs, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["endpoints"] == [
        {"port": "http-metrics", "path": "/metrics", "interval": "15s", "scrapeTimeout": "5s"}
    ]
    service = one(objs, "Service")
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}


def test_service_monitor_without_service_is_refused() -> None:
    values = {"metrics": {"service": {"enabled": False}, "serviceMonitor": {"enabled": True}}}
    assert "metrics.service.enabled" in render_error(values)


def test_router_per_group_routes_by_model() -> None:
    assert not [o for o in render() if o["metadata"]["name"].endswith("-router-demo")]
    objs = render(
        {
            "router": {
                "enabled": True,
                "groups": [{"name": "demo", "stages": ["tiny-llama", "tiny-diffusion"]}],
            }
        }
    )
    routers = [o for o in objs if "-router-" in o["metadata"]["name"]]
    assert sorted(o["kind"] for o in routers) == ["Deployment", "Service"]
    deployment = next(o for o in routers if o["kind"] == "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["omnistage-router"]
    assert container["args"] == [
        f"--namespace={NAMESPACE}",
        "--worker-port=8000",
        "--port=8080",
        "--stage=tiny-llama",
        "--stage=tiny-diffusion",
    ]
    service = next(o for o in routers if o["kind"] == "Service")
    assert service["spec"]["ports"][0]["port"] == 8080
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    refused = render_error(
        {"router": {"enabled": True, "groups": [{"name": "demo", "stages": []}]}}
    )
    assert "stages" in refused


def test_every_object_carries_the_chart_labels() -> None:
    objs = render(
        {"peering": {"enabled": True}, "metrics": {"serviceMonitor": {"enabled": True}}},
        api_versions=PEERING_APIS,
    )
    for obj in objs:
        labels = obj["metadata"].get("labels", {})
        assert labels.get("app.kubernetes.io/instance") == RELEASE, obj["metadata"]["name"]
        assert labels.get("app.kubernetes.io/managed-by") == "Helm", obj["metadata"]["name"]
