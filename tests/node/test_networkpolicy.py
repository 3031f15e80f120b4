"""The chart's NetworkPolicy, enforced on the real node by kube-network-policies.

Needs what ``tests/node/test_realnode.py`` needs, plus the enforcer (``python -m
tests.node.gotools``; ``make e2e-node`` builds it) and ``nft``. With the chart installed
(its policy for a stage namespace admitting HTTP from a namespace the user names), a stand-in
stage pod (the operator image serving the worker's HTTP and gRPC ports) is reached on HTTP from
that namespace and from pods with the stage's router's labels, on gRPC from pods with the
operator's labels, while a pod of another namespace times out on both; once the policy is
deleted the same pod gets through (so enforcement was on).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.cluster.build import BuildError, find_kubelet, find_node_binary
from tests.cluster.controlplane import ControlPlane
from tests.cluster.podwait import wait_pod
from tests.node.chart import enforce_restricted, install_on_node
from tests.node.gotools import NETPOL, find_tool
from tests.node.images import IMAGES, PAUSE, archive_path
from tests.node.netpol import Enforcer
from tests.node.netprobe import GRPC_PORT, HTTP_PORT, outcomes, probe, stand_in
from tests.node.realnode import RealNode

pytestmark = [pytest.mark.cluster, pytest.mark.node]
WORKER_LABELS = {"app.kubernetes.io/name": "omnistage-worker"}
# how long a probe that should be refused keeps trying (each attempt: a 2 s connect timeout)
WINDOW = 10.0


@pytest.fixture(scope="module")
def policed_node(control_plane: ControlPlane) -> Iterator[tuple[RealNode, Enforcer]]:
    try:
        kubelet, proxy = find_kubelet(), find_node_binary("kube-proxy")
        enforcer = find_tool(NETPOL) / NETPOL
    except BuildError as exc:
        pytest.fail(str(exc), pytrace=False)
    archives = (archive_path(PAUSE), archive_path(IMAGES["operator"]))
    for archive in archives:
        if not archive.is_file():
            pytest.fail(f"{archive} is missing: run `make images`", pytrace=False)
    with (
        RealNode(control_plane, kubelet, archives, kube_proxy=proxy) as node,
        Enforcer(
            control_plane, node.name, enforcer, subnet=node.layout.subnet, state=node.layout.state
        ) as netpol,
    ):
        yield node, netpol
    assert netpol.leftovers() == []


def _started(pod: dict[str, Any]) -> bool:
    statuses = pod.get("status", {}).get("containerStatuses") or [{}]
    return bool(pod["status"].get("podIP")) and statuses[0].get("started") is True


def _finished(pod: dict[str, Any]) -> bool:
    return pod.get("status", {}).get("phase") in ("Succeeded", "Failed")


def _probe_all(
    cp: ControlPlane,
    node: RealNode,
    target: str,
    probes: dict[str, tuple[str, dict[str, str], list[int]]],
) -> dict[str, dict[int, str]]:
    """Run the probes ``name -> (namespace, labels, ports)`` at once; their outcomes."""
    for name, (ns, labels, ports) in probes.items():
        cp.apply(probe(node.name, name, labels, target, ports=ports, window=WINDOW), namespace=ns)
    found = {}
    for name, (ns, _, _) in probes.items():
        pod = wait_pod(cp, ns, name, _finished, "finished", timeout=120)
        assert pod["status"]["phase"] == "Succeeded", json.dumps(pod["status"], indent=1)
        state = pod["status"]["containerStatuses"][0]["state"]["terminated"]
        found[name] = outcomes(state["message"])
    return found


def test_the_charts_policy_admits_its_clients_and_refuses_another_namespace(
    policed_node: tuple[RealNode, Enforcer], control_plane: ControlPlane
) -> None:
    node, netpol = policed_node
    cp = control_plane
    release_ns = cp.create_namespace("omnistage-system")
    stages, apps, other = (cp.create_namespace(p) for p in ("stages", "apps", "other"))
    for ns in (release_ns, stages, apps, other):
        enforce_restricted(cp, ns)
    allow_apps = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": apps}}}
    extra = {
        "networkPolicy": {"httpIngressFrom": [allow_apps], "httpFromSameNamespace": False},
        # a router group for the stage (its pod never starts: the worker image is not on the
        # node and is never pulled; the policy admits the router pods' labels)
        "router": {
            "enabled": True,
            "image": {"pullPolicy": "Never"},
            "groups": [{"name": "g", "stages": ["stage"], "namespace": stages}],
        },
    }
    release = install_on_node(cp, node.name, release_ns, [stages], extra=extra)
    try:
        deployment = cp.get_json("deployment", release.fullname, namespace=release_ns)
        operator_labels = deployment["spec"]["selector"]["matchLabels"]
        routers = cp.get_json(
            "deployments", "-l", "app.kubernetes.io/component=router", namespace=stages
        )
        (router,) = routers["items"]
        router_labels = router["spec"]["selector"]["matchLabels"]
        cp.apply(stand_in(node.name, "stage", WORKER_LABELS), namespace=stages)
        pod = wait_pod(cp, stages, "stage", _started, "started", timeout=120)
        ip = pod["status"]["podIP"]
        found = _probe_all(
            cp,
            node,
            ip,
            {
                "from-apps": (apps, {}, [HTTP_PORT, GRPC_PORT]),
                "from-operator": (release_ns, operator_labels, [GRPC_PORT]),
                "from-router": (stages, router_labels, [HTTP_PORT, GRPC_PORT]),
                "from-other": (other, {}, [HTTP_PORT, GRPC_PORT]),
            },
        )
        assert found == {
            "from-apps": {HTTP_PORT: "open", GRPC_PORT: "timeout"},
            "from-operator": {GRPC_PORT: "open"},
            "from-router": {HTTP_PORT: "open", GRPC_PORT: "timeout"},
            "from-other": {HTTP_PORT: "timeout", GRPC_PORT: "timeout"},
        }, netpol.verdicts()
        # enforcement off for the stand-in: the refused namespace gets through
        selector = f"app.kubernetes.io/instance={release.name}"
        cp.kubectl("delete", "networkpolicy", "-n", stages, "-l", selector)
        again = _probe_all(cp, node, ip, {"other-unpoliced": (other, {}, [HTTP_PORT, GRPC_PORT])})
        assert again == {"other-unpoliced": {HTTP_PORT: "open", GRPC_PORT: "open"}}
        assert netpol.running()
    finally:
        cp.helm("uninstall", release.name, "--namespace", release_ns, "--wait", check=False)
        for ns in (stages, apps, other, release_ns):
            cp.delete_namespace(ns)
