"""The real control plane: versions, DRA API, RBAC via ServiceAccount tokens, GC, timings."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from tests.cluster.build import K8S_VERSION, build_record
from tests.cluster.controlplane import ControlPlane
from tests.cluster.podwait import get_pod, wait_gone, wait_pod


def test_versions_are_stamped_and_dra_is_served(control_plane: ControlPlane) -> None:
    version = json.loads(control_plane.kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"] == K8S_VERSION
    assert version["clientVersion"]["gitVersion"] == K8S_VERSION
    resources = control_plane.kubectl(
        "api-resources", "--api-group=resource.k8s.io", "-o", "wide"
    ).stdout
    assert "resourceslices" in resources and "resource.k8s.io/v1" in resources
    helm = control_plane.helm("version", "--short").stdout
    assert helm.startswith("v3."), helm


def test_service_account_kubeconfig_is_subject_to_rbac(
    control_plane: ControlPlane, namespace: str
) -> None:
    kubeconfig = control_plane.service_account_kubeconfig(namespace, "reader")
    kubectl = str(control_plane.binaries.kubectl)

    def can_list() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [kubectl, f"--kubeconfig={kubeconfig}", "get", "configmaps", "-n", namespace],
            capture_output=True,
            text=True,
            check=False,
        )

    denied = can_list()
    assert denied.returncode != 0 and "forbidden" in denied.stderr.lower(), denied.stderr
    control_plane.kubectl(
        "create", "role", "reader", "-n", namespace, "--verb=list", "--resource=configmaps"
    )
    control_plane.kubectl(
        "create",
        "rolebinding",
        "reader",
        "-n",
        namespace,
        "--role=reader",
        f"--serviceaccount={namespace}:reader",
    )
    deadline = time.monotonic() + 20
    while (allowed := can_list()).returncode != 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert allowed.returncode == 0, allowed.stderr


def test_owner_reference_garbage_collection(control_plane: ControlPlane, namespace: str) -> None:
    control_plane.kubectl("create", "configmap", "owner", "-n", namespace)
    owner = control_plane.get_json("configmap", "owner", namespace=namespace)
    owned = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "owned",
            "ownerReferences": [
                {
                    "apiVersion": "v1",
                    "kind": "ConfigMap",
                    "name": "owner",
                    "uid": owner["metadata"]["uid"],
                }
            ],
        },
    }
    control_plane.apply(owned, namespace=namespace)
    control_plane.kubectl("delete", "configmap", "owner", "-n", namespace)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if (
            control_plane.kubectl(
                "get", "configmap", "owned", "-n", namespace, check=False
            ).returncode
            != 0
        ):
            break
        time.sleep(0.2)
    else:
        raise AssertionError("the garbage collector did not delete the owned ConfigMap within 30s")


def test_owned_pods_go_with_their_owner(
    control_plane: ControlPlane, local_nodes: object, namespace: str
) -> None:
    control_plane.kubectl("create", "configmap", "owner", "-n", namespace)
    uid = control_plane.get_json("configmap", "owner", namespace=namespace)["metadata"]["uid"]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "child",
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": uid}
            ],
        },
        "spec": {
            "terminationGracePeriodSeconds": 5,
            "containers": [
                {
                    "name": "main",
                    "image": "x",
                    "command": ["python", "-m", "tests.cluster.testpods.envdump", "--sleep"],
                }
            ],
        },
    }
    control_plane.apply(pod, namespace=namespace)
    wait_pod(
        control_plane,
        namespace,
        "child",
        lambda p: p["status"].get("phase") == "Running",
        "Running",
    )
    control_plane.kubectl("delete", "configmap", "owner", "-n", namespace)
    wait_gone(control_plane, namespace, "child", timeout=60)
    assert get_pod(control_plane, namespace, "child") is None


def test_timing_figures(control_plane: ControlPlane) -> None:
    record = build_record()
    start = control_plane.timings["start"]
    print(
        f"cold build {record['seconds']}s (cold={record['cold']}); control plane start {start:.1f}s"
    )
    assert float(str(record["seconds"])) > 0
    assert start < 60, f"control plane took {start:.1f}s to start"


def test_helm_install_upgrade_uninstall(
    control_plane: ControlPlane, namespace: str, tmp_path: Path
) -> None:
    chart = tmp_path / "probe"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text(
        "apiVersion: v2\nname: probe\nversion: 0.1.0\nkubeVersion: '>=1.36.0-0'\n"
    )
    (chart / "values.yaml").write_text("color: blue\n")
    (chart / "templates" / "cm.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ .Release.Name }}-cm\n"
        "data:\n  color: {{ .Values.color | quote }}\n"
        "  kube: {{ .Capabilities.KubeVersion.Version | quote }}\n"
    )
    lint = control_plane.helm("lint", "--strict", str(chart))
    assert "1 chart(s) linted, 0 chart(s) failed" in lint.stdout
    control_plane.helm("install", "rel", str(chart), "-n", namespace, "--wait", "--timeout", "60s")
    cm = control_plane.get_json("configmap", "rel-cm", namespace=namespace)
    assert cm["data"] == {"color": "blue", "kube": K8S_VERSION}
    control_plane.helm("upgrade", "rel", str(chart), "-n", namespace, "--set", "color=red")
    assert (
        control_plane.get_json("configmap", "rel-cm", namespace=namespace)["data"]["color"] == "red"
    )
    control_plane.helm("uninstall", "rel", "-n", namespace, "--wait")
    gone = control_plane.kubectl("get", "configmap", "rel-cm", "-n", namespace, check=False)
    assert gone.returncode != 0


def test_without_controller_manager_namespaces_still_get_their_service_account() -> None:
    """The GPU host's bundle leaves the controller-manager out (bench/gpu_bundle.py)."""
    with ControlPlane(controller_manager=False) as cp:
        assert not cp.logs("kube-controller-manager").exists()
        ns = cp.create_namespace("nokcm")
        cp.kubectl("get", "serviceaccount", "default", "-n", ns)
        # with no service-account controller, nothing else creates it: the pod is admitted
        cp.kubectl("run", "p", "-n", ns, "--image=x", "--restart=Never")
        assert cp.get_json("pod", "p", namespace=ns)["spec"]["serviceAccountName"] == "default"
