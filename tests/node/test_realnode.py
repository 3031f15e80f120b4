"""A real kubelet + containerd node: it registers, runs the built images, tears down fully.

Needs root, Debian's containerd, runc and containernetworking-plugins, the kubelet
(``python -m tests.cluster.build --node``) and the images (``python -m tests.node.images pause
operator``); ``make e2e-node`` does all of it. Nothing here is skipped: a missing piece fails
with the command that provides it.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Iterator

import pytest

from tests.cluster.build import K8S_VERSION, BuildError, find_kubelet
from tests.cluster.controlplane import ControlPlane
from tests.cluster.podwait import wait_gone, wait_pod
from tests.node.images import IMAGES, PAUSE, archive_path
from tests.node.realnode import RealNode

pytestmark = [pytest.mark.cluster, pytest.mark.node]
OPERATOR = IMAGES["operator"]


@pytest.fixture(scope="module")
def real_node(control_plane: ControlPlane) -> Iterator[RealNode]:
    try:
        kubelet = find_kubelet()
    except BuildError as exc:
        pytest.fail(str(exc), pytrace=False)
    archives = (archive_path(PAUSE), archive_path(OPERATOR))
    for archive in archives:
        if not archive.is_file():
            pytest.fail(f"{archive} is missing: run `make images`", pytrace=False)
    with RealNode(control_plane, kubelet, archives) as node:
        yield node


def test_kubelet_registers_a_ready_node_on_containerd(real_node: RealNode) -> None:
    node = real_node.node()
    info = node["status"]["nodeInfo"]
    assert info["kubeletVersion"] == K8S_VERSION
    assert info["containerRuntimeVersion"].startswith("containerd://")
    assert node["metadata"]["labels"]["kubernetes.io/hostname"] == real_node.name
    assert real_node.node_ready()
    # the images came from archives, not a registry
    held = real_node.images()
    assert PAUSE.ref in held and OPERATOR.ref in held, held


def _operator_pod(node: str) -> dict[str, object]:
    """The operator image under the chart's security context, printing its flags and exiting."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "operator-image"},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": node},
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "securityContext": {
                "runAsNonRoot": True,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": [
                {
                    "name": "operator",
                    "image": OPERATOR.ref,
                    "imagePullPolicy": "Never",
                    "command": ["/bin/sh", "-c"],
                    "args": [
                        "id -u > /dev/termination-log && "
                        "omnistage-operator --help | grep -q -- --worker-token-file && "
                        "echo help-ok >> /dev/termination-log"
                    ],
                    "securityContext": {
                        "allowPrivilegeEscalation": False,
                        "readOnlyRootFilesystem": True,
                        "capabilities": {"drop": ["ALL"]},
                    },
                }
            ],
        },
    }


def test_operator_image_runs_in_a_real_container(
    real_node: RealNode, control_plane: ControlPlane, namespace: str
) -> None:
    control_plane.apply(_operator_pod(real_node.name), namespace=namespace)
    pod = wait_pod(
        control_plane,
        namespace,
        "operator-image",
        lambda p: p.get("status", {}).get("phase") in ("Succeeded", "Failed"),
        "finished",
        timeout=180,
    )
    state = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    assert pod["status"]["phase"] == "Succeeded", json.dumps(pod["status"], indent=1)
    assert state["exitCode"] == 0
    # USER 65532 of the image, and its entry point works under the chart's restrictions
    assert state["message"].split() == ["65532", "help-ok"], state["message"]
    assert pod["spec"]["nodeName"] == real_node.name
    pod_ip = ipaddress.ip_address(pod["status"]["podIP"])
    assert pod_ip in ipaddress.ip_network(real_node.layout.subnet), pod_ip
    # the sandbox is the pause image built here
    sandboxes = real_node.ctr("containers", "ls")
    assert PAUSE.ref in sandboxes, sandboxes
    control_plane.kubectl("delete", "pod", "operator-image", "-n", namespace, "--wait=false")
    wait_gone(control_plane, namespace, "operator-image", timeout=60)


def test_teardown_leaves_nothing(real_node: RealNode) -> None:
    """Run last in this module: the node stops and nothing of it remains on the machine."""
    real_node.stop()
    assert real_node.leftovers() == []
