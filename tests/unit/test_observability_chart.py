"""The chart's dashboard, alert rules, worker PodMonitor and metrics NetworkPolicy: rendered only
when enabled, and every metric a panel or an alert reads is one the code exports."""

from __future__ import annotations

import json
import re
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry

from omnistage_worker.metrics import EXPORTED
from tests.unit.test_chart_support import CHART_DIR, NAMESPACE, one, render, run_helm, select

ON = {
    "metrics": {
        "dashboard": {"enabled": True},
        "prometheusRule": {"enabled": True, "waitingFor": "20m"},
        "workers": {
            "podMonitor": {"enabled": True},
            "ingressFrom": [
                {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "mon"}}}
            ],
        },
    },
    "logFormat": "json",
}
ALERTS = {
    "OmniStageAckContradicted",
    "OmniStageFailed",
    "OmniStageWaitingTooLong",
    "OmniStageLargerThanRoom",
    "OmniStageWakeOutOfMemory",
    "OmniStageLeaderAbsent",
}
_HISTOGRAM_SUFFIXES = ("_bucket", "_count", "_sum")


def _samples(registry: CollectorRegistry) -> set[str]:
    """Every sample name the registry's counters, gauges and histograms produce."""
    names = set()
    for family in registry.collect():
        if family.type == "counter":
            names.add(family.name + "_total")
        elif family.type == "histogram":
            names.update(family.name + s for s in _HISTOGRAM_SUFFIXES)
        else:
            names.add(family.name)
    return names


def exported() -> set[str]:
    """The sample names the operator (its registry) and a worker export (the worker's families
    are EXPORTED, which tests/worker/test_metrics.py checks against a real worker's scrape)."""
    import omnistage_operator.k8s.metrics  # noqa: F401  (registers the operator's metrics)

    worker = set(EXPORTED) | {n + s for n in EXPORTED for s in _HISTOGRAM_SUFFIXES}
    return {n for n in _samples(REGISTRY) if n.startswith("omnistage_")} | worker


def metric_names(text: str) -> set[str]:
    return set(re.findall(r"\bomnistage_[a-z_]+\b", text))


def test_nothing_rendered_by_default() -> None:
    objs = render()
    assert not select(objs, "PrometheusRule")
    assert not select(objs, "PodMonitor")
    assert not [o for o in select(objs, "ConfigMap") if o["metadata"]["name"].endswith("dashboard")]
    names = {o["metadata"]["name"] for o in select(objs, "NetworkPolicy")}
    assert not any(n.endswith("worker-metrics") for n in names)
    args = one(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not any(a.startswith("--log-format") for a in args)  # text: the operator's default


def test_enabled_objects() -> None:
    objs = render(ON)
    args = one(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--log-format=json" in args
    from omnistage_operator.k8s.settings import parse_settings

    assert parse_settings(args, {}).log_format == "json"  # the operator takes what is rendered
    dashboard = one(objs, "ConfigMap", NAMESPACE)
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    board = json.loads(dashboard["data"]["omnistage.json"])
    assert board["uid"] == "omnistage" and len(board["panels"]) >= 10
    rule = one(objs, "PrometheusRule")
    rules = rule["spec"]["groups"][0]["rules"]
    assert {r["alert"] for r in rules} == ALERTS
    waiting = next(r for r in rules if r["alert"] == "OmniStageWaitingTooLong")
    assert waiting["for"] == "20m"
    monitor = one(objs, "PodMonitor")
    assert monitor["spec"]["selector"] == {
        "matchLabels": {"app.kubernetes.io/name": "omnistage-worker"}
    }
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    policy = next(
        o for o in select(objs, "NetworkPolicy") if o["metadata"]["name"].endswith("worker-metrics")
    )
    (ingress,) = policy["spec"]["ingress"]
    assert ingress["ports"] == [{"protocol": "TCP", "port": 9464}]
    assert ingress["from"] == ON["metrics"]["workers"]["ingressFrom"]  # type: ignore[index]


def test_every_metric_a_panel_or_alert_reads_is_exported() -> None:
    """A renamed metric breaks this test, not a user's dashboard."""
    objs = render(ON)
    known = exported()
    board: Any = json.loads(one(objs, "ConfigMap", NAMESPACE)["data"]["omnistage.json"])
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
    exprs.append(board["templating"]["list"][1]["query"])
    exprs += [r["expr"] for r in one(objs, "PrometheusRule")["spec"]["groups"][0]["rules"]]
    used = set().union(*(metric_names(e) for e in exprs))
    assert used and used <= known, used - known
    # Both sides are covered: operator and worker metrics.
    assert any(n.startswith("omnistage_worker_") for n in used)
    assert any(not n.startswith("omnistage_worker_") for n in used)


def test_helm_lint_strict_with_everything_on() -> None:
    args = [
        "--set",
        "metrics.dashboard.enabled=true",
        "--set",
        "metrics.prometheusRule.enabled=true",
    ]
    args += ["--set", "metrics.workers.podMonitor.enabled=true", "--set", "logFormat=json"]
    proc = run_helm("lint", "--strict", str(CHART_DIR), *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_bad_log_format_is_refused() -> None:
    from tests.unit.test_chart_support import render_error

    assert "logFormat" in render_error({"logFormat": "xml"})
