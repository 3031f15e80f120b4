"""A real kubelet + containerd node: it registers, runs the built images, tears down fully.

The node runs containerd 1.7 built from its module (CDI on) and has one simulated GPU, which a
pod claims through DRA and gets through CDI. Needs root, Debian's containerd (``ctr``), runc,
iptables and containernetworking-plugins, the kubelet and kube-proxy (``python -m
tests.cluster.build --node``), containerd 1.7 and the DRA plugin (``python -m
tests.node.gotools``) and the images (``python -m tests.node.images pause operator``); ``make
e2e-node`` does all of it. Nothing here is skipped: a missing piece fails with the command that
provides it.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.cluster.build import K8S_VERSION, BuildError, find_kubelet, find_node_binary
from tests.cluster.controlplane import ControlPlane
from tests.cluster.localnode.devices import DEVICE_CLASS, DRIVER
from tests.cluster.podwait import wait_gone, wait_pod
from tests.node.chart import enforce_restricted, install_on_node, operator_pod
from tests.node.gpuconfig import CONTAINER_GPU_ROOT, NodeGpus
from tests.node.images import IMAGES, PAUSE, archive_path
from tests.node.nodegpus import gpu_node_args
from tests.node.realnode import RealNode

pytestmark = [pytest.mark.cluster, pytest.mark.node]
OPERATOR = IMAGES["operator"]


@pytest.fixture(scope="module")
def real_node(control_plane: ControlPlane) -> Iterator[RealNode]:
    try:
        kubelet, proxy = find_kubelet(), find_node_binary("kube-proxy")
        gpu_args = gpu_node_args(NodeGpus())
    except BuildError as exc:
        pytest.fail(str(exc), pytrace=False)
    archives = (archive_path(PAUSE), archive_path(OPERATOR))
    for archive in archives:
        if not archive.is_file():
            pytest.fail(f"{archive} is missing: run `make images`", pytrace=False)
    with RealNode(control_plane, kubelet, archives, kube_proxy=proxy, **gpu_args) as node:
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


def _operator_pod(node: str) -> dict[str, Any]:
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


# Run in the operator image: kr8s's in-cluster configuration (the Service's environment, the
# projected token and CA), as the operator itself connects; SelfSubjectReview needs no RBAC.
_WHOAMI = """
import asyncio, json, os
import kr8s.asyncio

async def main():
    api = await kr8s.asyncio.api()
    body = json.dumps({"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"})
    async with api.call_api(
        "POST", version="authentication.k8s.io/v1", url="selfsubjectreviews", content=body
    ) as r:
        user = r.json()["status"]["userInfo"]["username"]
    with open("/dev/termination-log", "w") as out:
        print(os.environ["KUBERNETES_SERVICE_HOST"], user, file=out)

asyncio.run(main())
"""


def test_a_pod_reads_the_api_through_the_kubernetes_service(
    real_node: RealNode, control_plane: ControlPlane, namespace: str
) -> None:
    """The API server advertises the host's address; kube-proxy routes the ClusterIP to it."""
    endpoints = control_plane.get_json("endpointslices", namespace="default")["items"]
    addresses = [a for e in endpoints for ep in e["endpoints"] for a in ep["addresses"]]
    assert addresses == [control_plane.advertise_ip], addresses
    pod = _operator_pod(real_node.name)
    pod["metadata"]["name"] = "api-reader"
    pod["spec"]["automountServiceAccountToken"] = True
    pod["spec"]["containers"][0]["command"] = ["python3", "-c", _WHOAMI]
    del pod["spec"]["containers"][0]["args"]
    control_plane.apply(pod, namespace=namespace)
    done = wait_pod(
        control_plane,
        namespace,
        "api-reader",
        lambda p: p.get("status", {}).get("phase") in ("Succeeded", "Failed"),
        "finished",
        timeout=180,
    )
    state = done["status"]["containerStatuses"][0]["state"]["terminated"]
    assert done["status"]["phase"] == "Succeeded", json.dumps(done["status"], indent=1)
    service = control_plane.get_json("service", "kubernetes", namespace="default")
    assert state["message"].split() == [
        service["spec"]["clusterIP"],
        f"system:serviceaccount:{namespace}:default",
    ], state["message"]
    control_plane.kubectl("delete", "pod", "api-reader", "-n", namespace, "--wait=false")
    wait_gone(control_plane, namespace, "api-reader", timeout=60)


def _stage(node: str) -> dict[str, Any]:
    """A stage without a GPU on the real node (its worker image need not be there)."""
    return {
        "apiVersion": "omnistage.io/v1alpha1",
        "kind": "OmniStage",
        "metadata": {"name": "tiny"},
        "spec": {
            "runner": "AR",
            "backend": "Transformers",
            "image": IMAGES["worker"].ref,
            "model": {"path": "/models/m", "mountPath": "/models", "volume": {"emptyDir": {}}},
            "state": "Active",
            "colocation": {"group": "g"},
            "gpus": 0,
            "worker": {"device": "cpu"},
            "template": {"nodeSelector": {"kubernetes.io/hostname": node}},
        },
    }


def test_helm_installs_the_operator_on_the_node_under_restricted_pod_security(
    real_node: RealNode, control_plane: ControlPlane
) -> None:
    """The chart's operator runs in its container on the node, reaches the API through the
    ``kubernetes`` Service and serves a stage; both namespaces enforce ``restricted``."""
    release_ns = control_plane.create_namespace("omnistage-system")
    stages = control_plane.create_namespace("stages")
    for ns in (release_ns, stages):
        enforce_restricted(control_plane, ns)
    release = install_on_node(control_plane, real_node.name, release_ns, [stages])
    try:
        pod = operator_pod(control_plane, release, real_node.container_logs)
        assert pod["spec"]["nodeName"] == real_node.name
        assert pod["status"]["containerStatuses"][0]["restartCount"] == 0
        control_plane.apply(_stage(real_node.name), namespace=stages)
        try:
            worker = wait_pod(
                control_plane,
                stages,
                "tiny-worker",
                lambda p: p["spec"].get("nodeName") == real_node.name,
                "created by the operator and scheduled on the node",
                timeout=120,
            )
        except AssertionError as exc:
            stage = control_plane.get_json("omnistage", "tiny", namespace=stages)
            logs = real_node.container_logs(release_ns, pod["metadata"]["name"], tail=60)
            raise AssertionError(f"{exc}\nstage status: {stage.get('status')}\n{logs}") from None
        assert worker["spec"]["securityContext"]["runAsNonRoot"] is True
        assert control_plane.get_json("service", "tiny-worker", namespace=stages)
        # deleted while the operator runs: it releases its finalizer
        control_plane.kubectl("delete", "omnistage", "tiny", "-n", stages, "--timeout=120s")
    finally:
        control_plane.helm("uninstall", release.name, "--namespace", release_ns, "--wait")
        unfinalize = ["--type", "merge", "-p", '{"metadata":{"finalizers":null}}']
        control_plane.kubectl("patch", "omnistage", "tiny", "-n", stages, *unfinalize, check=False)
        for ns in (stages, release_ns):
            control_plane.delete_namespace(ns)


# In the operator image (python3): what a GPU claim gave the container, and the host pid the
# simulated GPU's host side (driver.sock, tests.fakegpu.driver) knows it by.
_GPU_READER = """
import json, os, socket
gpu = os.environ["OMNISTAGE_FAKE_GPU"]
with open(os.path.join(gpu, "device.json")) as f:
    uuid = json.load(f)["uuid"]
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.connect(os.path.join(gpu, "driver.sock"))
sock.sendall(b'{"op": "self"}\\n')
host_pid = json.loads(sock.makefile().readline())["pid"]
with open("/dev/termination-log", "w") as out:
    print(gpu, uuid, os.environ["CUDA_VISIBLE_DEVICES"], os.getpid(), host_pid, file=out)
"""


def _claim() -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "one-gpu"},
        "spec": {
            "devices": {
                "requests": [
                    {"name": "gpu", "exactly": {"deviceClassName": DEVICE_CLASS, "count": 1}}
                ]
            }
        },
    }


def test_a_gpu_claim_reaches_a_restricted_pod_through_cdi(
    real_node: RealNode, control_plane: ControlPlane, namespace: str
) -> None:
    """A pod under the ``restricted`` Pod Security Standard claims a simulated GPU: the DRA
    plugin prepares the claim, containerd's CDI mounts the device's directory and sets the
    worker's variables; no hostPath anywhere."""
    enforce_restricted(control_plane, namespace)
    control_plane.apply(_claim(), namespace=namespace)
    pod = _operator_pod(real_node.name)
    pod["metadata"]["name"] = "gpu-reader"
    pod["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimName": "one-gpu"}]
    container = pod["spec"]["containers"][0]
    container["command"] = ["python3", "-c", _GPU_READER]
    del container["args"]
    container["resources"] = {"claims": [{"name": "gpu"}]}
    container["terminationMessagePolicy"] = "FallbackToLogsOnError"
    control_plane.apply(pod, namespace=namespace)
    done = wait_pod(
        control_plane,
        namespace,
        "gpu-reader",
        lambda p: p.get("status", {}).get("phase") in ("Succeeded", "Failed"),
        "finished",
        timeout=180,
    )
    assert done["status"]["phase"] == "Succeeded", json.dumps(done["status"], indent=1)
    state = done["status"]["containerStatuses"][0]["state"]["terminated"]
    gpu_dir, uuid, visible, pid, host_pid = state["message"].split()
    device = real_node.gpu_devices[0]
    assert (gpu_dir, uuid, visible) == (f"{CONTAINER_GPU_ROOT}/gpu-0", device.uuid, device.uuid)
    assert int(pid) != int(host_pid)  # its own PID namespace; the host side knows the host's
    # the device came from the plugin's ResourceSlice for this node
    selector = f"spec.nodeName={real_node.name}"
    slices = control_plane.get_json("resourceslices", "--field-selector", selector)["items"]
    published = [(s["spec"]["driver"], d["name"]) for s in slices for d in s["spec"]["devices"]]
    assert published == [(DRIVER, "gpu-0")], published
    control_plane.kubectl("delete", "pod", "gpu-reader", "-n", namespace, "--wait=false")
    wait_gone(control_plane, namespace, "gpu-reader", timeout=60)
    control_plane.kubectl("delete", "resourceclaim", "one-gpu", "-n", namespace)


def test_teardown_leaves_nothing(real_node: RealNode) -> None:
    """Run last in this module: the node stops and nothing of it remains on the machine."""
    real_node.stop()
    assert real_node.leftovers() == []
