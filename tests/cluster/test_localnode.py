"""localnode: scheduling by the real scheduler, processes, probes, readiness, deletion and its
grace period, nodes."""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.cluster.controlplane import ControlPlane
from tests.cluster.localnode import LocalNodes
from tests.cluster.podwait import condition, is_ready, wait_gone, wait_pod

PY = "python"
GiB = 1024**3


def _pid(pod: dict[str, Any], index: int = 0) -> int:
    cid = pod["status"]["containerStatuses"][index]["containerID"]
    assert cid.startswith("localnode://"), cid
    return int(cid.removeprefix("localnode://"))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def health_pod(name: str, grace: int = 10) -> dict[str, Any]:
    """A pod running the tiny gRPC health server on its podIP with a gRPC readiness probe."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {
            "terminationGracePeriodSeconds": grace,
            "containers": [
                {
                    "name": "server",
                    "image": "ignored:latest",
                    "command": [PY, "-m", "tests.cluster.testpods.health_server"],
                    "args": ["--host", "$(POD_IP)", "--port", "50051"],
                    "env": [
                        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
                    ],
                    "ports": [{"name": "grpc", "containerPort": 50051}],
                    "readinessProbe": {
                        "grpc": {"port": 50051},
                        "periodSeconds": 1,
                        "failureThreshold": 2,
                    },
                    "livenessProbe": {
                        "tcpSocket": {"port": "grpc"},
                        "periodSeconds": 2,
                        "initialDelaySeconds": 3,
                    },
                }
            ],
        },
    }


def test_pod_is_scheduled_runs_becomes_ready_and_deletion_ends_it(
    control_plane: ControlPlane, local_nodes: LocalNodes, namespace: str
) -> None:
    control_plane.apply(health_pod("web"), namespace=namespace)
    pod = wait_pod(control_plane, namespace, "web", is_ready, "Ready", timeout=60)
    assert pod["spec"]["nodeName"] == "gpu-node-0"  # bound by the real scheduler
    sched = condition(pod, "PodScheduled")
    assert sched is not None and sched["status"] == "True"
    ip = pod["status"]["podIP"]
    host_ip = local_nodes.node_ip(0)
    assert ip.startswith(host_ip.rsplit(".", 1)[0] + ".") and ip != host_ip, ip
    assert pod["status"]["hostIP"] == host_ip
    status = pod["status"]["containerStatuses"][0]
    assert status["ready"] and status["started"] and "running" in status["state"]
    # the podIP is reachable: the real gRPC health service answers there
    with grpc.insecure_channel(f"{ip}:50051") as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    pid = _pid(pod)
    assert _alive(pid)
    log = local_nodes.pod_log(pod, "server")
    assert f"serving on {ip}:50051" in log

    started = time.monotonic()
    control_plane.kubectl("delete", "pod", "web", "-n", namespace, "--wait=false")
    wait_gone(control_plane, namespace, "web", timeout=30)
    assert not _alive(pid), "the pod object went away while its process still ran"
    assert time.monotonic() - started < 9, (
        "SIGTERM should have ended the server well inside the grace period"
    )
    assert "SIGTERM: stopping" in local_nodes.pod_log(pod, "server")


def test_held_deletion_keeps_the_pod_terminating_until_released(
    control_plane: ControlPlane, local_nodes: LocalNodes, namespace: str
) -> None:
    control_plane.apply(health_pod("held", grace=5), namespace=namespace)
    pod = wait_pod(control_plane, namespace, "held", is_ready, "Ready", timeout=60)
    pid = _pid(pod)
    local_nodes.hold_deletions("held", namespace)
    try:
        control_plane.kubectl("delete", "pod", "held", "-n", namespace, "--wait=false")
        watched_until = time.monotonic() + 8  # longer than the grace period
        while time.monotonic() < watched_until:  # the kubelet never confirms the deletion
            still = control_plane.get_json("pod", "held", namespace=namespace)
            assert still["metadata"].get("deletionTimestamp") and _alive(pid)
            time.sleep(0.5)
        with grpc.insecure_channel(f"{pod['status']['podIP']}:50051") as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING  # still serving
    finally:
        local_nodes.release_deletions("held", namespace)
    wait_gone(control_plane, namespace, "held", timeout=30)
    assert not _alive(pid)


def test_extra_nodes_from_the_factory(
    control_plane: ControlPlane, make_local_nodes: Any, namespace: str
) -> None:
    extra: LocalNodes = make_local_nodes(nodes=2, gpus=1, gpu_memory=16 * GiB)
    assert len(extra.node_names) == 2
    nodes = control_plane.get_json("nodes", "-l", "localnode.omnistage.io/node=true")["items"]
    names = {n["metadata"]["name"] for n in nodes}
    assert set(extra.node_names) <= names
    node = next(n for n in nodes if n["metadata"]["name"] == extra.node_names[1])
    assert node["status"]["capacity"]["nvidia.com/gpu"] == "1"
    slices = control_plane.get_json(
        "resourceslices", "--field-selector", f"spec.nodeName={extra.node_names[1]}"
    )
    devices = slices["items"][0]["spec"]["devices"]
    assert [d["name"] for d in devices] == ["gpu-0"]
    assert devices[0]["capacity"]["memory"]["value"] == "16Gi"


def _stubborn_pod(name: str, grace: int, node: str | None = None) -> dict[str, Any]:
    """A pod whose process ignores SIGTERM (so only SIGKILL after the grace period ends it)."""
    script = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('up', flush=True); time.sleep(600)"
    )
    spec: dict[str, Any] = {
        "terminationGracePeriodSeconds": grace,
        "containers": [{"name": "main", "image": "ignored", "command": [PY, "-c", script]}],
    }
    if node:
        spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def test_grace_period_then_sigkill_and_object_goes_last(
    control_plane: ControlPlane, local_nodes: LocalNodes, namespace: str
) -> None:
    control_plane.apply(_stubborn_pod("stubborn", grace=3), namespace=namespace)
    pod = wait_pod(
        control_plane,
        namespace,
        "stubborn",
        lambda p: p["status"].get("phase") == "Running",
        "Running",
    )
    pid = _pid(pod)
    deleted = time.monotonic()
    control_plane.kubectl("delete", "pod", "stubborn", "-n", namespace, "--wait=false")
    # the process ignores SIGTERM: the object must stay while the process lives
    time.sleep(1.5)
    assert _alive(pid)
    still = control_plane.get_json("pod", "stubborn", namespace=namespace)
    assert still["metadata"].get("deletionTimestamp")
    wait_gone(control_plane, namespace, "stubborn", timeout=30)
    assert not _alive(pid)
    assert time.monotonic() - deleted >= 3, "the pod went before its grace period ended"


def test_liveness_failure_restarts_the_container(
    control_plane: ControlPlane, local_nodes: LocalNodes, namespace: str
) -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "unlively"},
        "spec": {
            "terminationGracePeriodSeconds": 2,
            "containers": [
                {
                    "name": "main",
                    "image": "ignored",
                    "command": [PY, "-c", "import time; time.sleep(600)"],
                    "livenessProbe": {
                        "exec": {"command": [PY, "-c", "raise SystemExit(1)"]},
                        "periodSeconds": 1,
                        "failureThreshold": 2,
                    },
                }
            ],
        },
    }
    control_plane.apply(pod, namespace=namespace)
    restarted = wait_pod(
        control_plane,
        namespace,
        "unlively",
        lambda p: any(
            c.get("restartCount", 0) >= 1 for c in p["status"].get("containerStatuses") or []
        ),
        "restarted by its liveness probe",
        timeout=60,
    )
    last = restarted["status"]["containerStatuses"][0]["lastState"]["terminated"]
    assert last["exitCode"] == 128 + 15  # SIGTERM from the kubelet's kill
    events = control_plane.get_json(
        "events", "--field-selector", "involvedObject.name=unlively", namespace=namespace
    )["items"]
    reasons = {e["reason"] for e in events if e["source"].get("component") == "kubelet"}
    assert {"Started", "Killing"} <= reasons, reasons


def test_stopping_localnode_kills_its_pods_and_removes_its_nodes(
    control_plane: ControlPlane, make_local_nodes: Any, namespace: str
) -> None:
    extra: LocalNodes = make_local_nodes(nodes=1, gpus=1)
    node = extra.node_names[0]
    control_plane.apply(_stubborn_pod("orphan", grace=30, node=node), namespace=namespace)
    pod = wait_pod(
        control_plane,
        namespace,
        "orphan",
        lambda p: p["status"].get("phase") == "Running",
        "Running",
    )
    assert pod["spec"]["nodeName"] == node
    pid = _pid(pod)
    extra.stop()
    assert not _alive(pid), "localnode exited but left its pod's process running"
    gone = control_plane.kubectl("get", "node", node, check=False)
    assert gone.returncode != 0 and "NotFound" in gone.stderr


def test_pods_still_run_after_the_pod_watch_reopens(
    control_plane: ControlPlane, make_local_nodes: Any, namespace: str
) -> None:
    extra: LocalNodes = make_local_nodes(nodes=1, gpus=1, extra_args=["--watch-timeout=1"])
    node = extra.node_names[0]
    deadline = time.monotonic() + 30
    while extra.log.read_text().count("pod watch (re)opened") < 3:
        assert time.monotonic() < deadline, "the pod watch was not reopened 3 times in 30s"
        time.sleep(0.2)
    pod = _stubborn_pod("late", grace=1, node=node)
    control_plane.apply(pod, namespace=namespace)
    running = wait_pod(
        control_plane, namespace, "late", lambda p: p["status"].get("phase") == "Running", "Running"
    )
    pid = _pid(running)
    control_plane.kubectl("delete", "pod", "late", "-n", namespace, "--wait=false")
    wait_gone(control_plane, namespace, "late", timeout=30)
    assert not _alive(pid)


def test_http_server_with_startup_and_http_readiness_probes(
    control_plane: ControlPlane, local_nodes: LocalNodes, namespace: str
) -> None:
    http_get = {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1}
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "files"},
        "spec": {
            "terminationGracePeriodSeconds": 3,
            "containers": [
                {
                    "name": "web",
                    "image": "ignored",
                    "command": [PY, "-m", "http.server", "8080", "--bind", "$(POD_IP)"],
                    "env": [
                        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
                    ],
                    "ports": [{"name": "http", "containerPort": 8080}],
                    "startupProbe": {**http_get, "failureThreshold": 30},
                    "readinessProbe": http_get,
                }
            ],
        },
    }
    control_plane.apply(pod, namespace=namespace)
    ready = wait_pod(control_plane, namespace, "files", is_ready, "Ready")
    status = ready["status"]["containerStatuses"][0]
    assert status["started"] and status["ready"]
    with socket.create_connection((ready["status"]["podIP"], 8080), timeout=5) as conn:
        conn.sendall(b"GET / HTTP/1.0\r\n\r\n")
        assert conn.recv(12).startswith(b"HTTP/1.0 200")
