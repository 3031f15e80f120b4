"""localnode at scale: hundreds of nodes on one API client, and pods served by simulated hosts.

300 nodes (more than one /24 block of node addresses) with 8 simulated GPUs each come up Ready,
untainted, each with its ResourceSlice and its own address, on one connection pool and one pod
watch; localnode reports its own API requests per second and CPU; its steady heartbeat stays
near one Lease renewal per node per 10 s (plus a status post per node per minute). Then a pod
running ``omnistage-worker`` on one of them is served by a simulated worker host (no process of
its own) and becomes Ready through its gRPC readiness probe.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.controlplane import ControlPlane
from tests.cluster.localnode import LocalNodes
from tests.cluster.podwait import wait_pod

pytestmark = [pytest.mark.timeout(600)]
NODES = 300
WORKER_ARGS = [
    "--runner", "ar", "--backend", "transformers", "--model", "/models/m",
    "--host=$(POD_IP)", "--port", "50051", "--device", "cpu",
]  # fmt: skip


def _worker_pod(node: str, model: Path) -> dict[str, Any]:
    """A worker pod whose model directory is a hostPath (localnode mounts it locally)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "simworker"},
        "spec": {
            "nodeName": node,
            "restartPolicy": "Never",
            "volumes": [{"name": "model", "hostPath": {"path": str(model), "type": "Directory"}}],
            "containers": [
                {
                    "name": "worker",
                    "image": "ignored",
                    "command": ["omnistage-worker"],
                    "args": WORKER_ARGS,
                    "env": [
                        {
                            "name": "POD_IP",
                            "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
                        },
                        {"name": "NVIDIA_VISIBLE_DEVICES", "value": "gpu-3"},
                        {"name": "OMNISTAGE_SIM_WEIGHTS", "value": str(8 << 30)},
                    ],
                    "readinessProbe": {"grpc": {"port": 50051}, "periodSeconds": 1},
                    "volumeMounts": [{"name": "model", "mountPath": "/models/m"}],
                }
            ],
        },
    }


def test_hundreds_of_nodes_and_a_simulated_worker(
    control_plane: ControlPlane, namespace: str, tmp_path: Path
) -> None:
    with LocalNodes(
        control_plane.kubeconfig, nodes=NODES, gpus=8, name_prefix="many-", sim_hosts=2,
        ready_timeout=400,
    ) as nodes:  # fmt: skip
        last = nodes.node_names[-1]
        node = control_plane.get_json("node", last)
        assert node["status"]["addresses"][0]["address"] == nodes.node_ip(NODES - 1)
        assert nodes.node_ip(NODES - 1) == f"127.{nodes.ip_octet + 1}.{(NODES - 1) % 250}.1"
        slices = control_plane.get_json("resourceslices")["items"]
        ours = [s for s in slices if s["spec"]["nodeName"].startswith("many-")]
        assert len(ours) == NODES and all(len(s["spec"]["devices"]) == 8 for s in ours)

        def settled_stats() -> dict[str, Any]:
            first = nodes.stats().get("requests_total", 0)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                stats = nodes.stats()
                if stats.get("requests_total", 0) > first:
                    return stats
                time.sleep(1)
            raise AssertionError("localnode wrote no figures in 60 s")

        first = settled_stats()
        # The rate over a whole status cycle (6 heartbeats of 10 s), not one 5 s window of the
        # figures: a window that catches a heartbeat burst of every node reads twice the mean.
        deadline = time.monotonic() + 120
        steady = first
        while steady["time"] < first["time"] + 60 and time.monotonic() < deadline:
            time.sleep(1)
            steady = nodes.stats() or steady
        span = steady["time"] - first["time"]
        assert span >= 60, (first, steady)
        rate = (steady["requests_total"] - first["requests_total"]) / span
        assert steady["nodes"] == NODES
        assert steady["cpu_s"] > 0 and steady["rss_mib"] > 0
        # a Lease per node per 10 s, a status per node per 60 s, some slack
        assert rate <= NODES / 10 + NODES / 60 + 10, (rate, steady)

        model = tmp_path / "model"
        model.mkdir()
        control_plane.apply(_worker_pod(nodes.node_names[7], model), namespace=namespace)
        pod = wait_pod(
            control_plane, namespace, "simworker",
            lambda p: any(c.get("ready") for c in p["status"].get("containerStatuses") or []),
            "Ready", timeout=120,
        )  # fmt: skip
        hosts = nodes.sim_hosts()
        host = hosts[7 % len(hosts)]
        assert nodes.node_names[7] in host["nodes"]
        log = nodes.pod_log(pod, "worker")
        assert f"served by simulated worker host pid {host['pid']}" in log, log
