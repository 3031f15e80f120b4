"""The GPU hand-over bench counts the operator's share without kubectl's own process: it reads
the PATCH's round trip from the real ``kubectl -v=6`` (bench/gpu_e2e_cluster.py)."""

from __future__ import annotations

import json
import subprocess
import time

from bench.gpu_e2e_cluster import operator_shares, patch_latency_s
from tests.cluster.controlplane import ControlPlane


def test_the_patch_round_trip_is_read_from_real_kubectl(
    control_plane: ControlPlane, namespace: str
) -> None:
    kubectl = [str(control_plane.binaries.kubectl), f"--kubeconfig={control_plane.kubeconfig}"]
    subprocess.run(
        [*kubectl, "-n", namespace, "create", "configmap", "wish", "--from-literal=state=Asleep"],
        check=True,
        capture_output=True,
        timeout=60,
    )
    patch = json.dumps({"data": {"state": "Active"}})
    began = time.monotonic()
    done = subprocess.run(
        [
            *kubectl,
            "-v=6",
            "-n",
            namespace,
            "patch",
            "configmap",
            "wish",
            "--type=merge",
            "-p",
            patch,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    wall = time.monotonic() - began
    request = patch_latency_s(done.stderr)
    assert request is not None, done.stderr
    assert 0 <= request < wall
    assert patch_latency_s("I1129 GET https://x/api 200 OK in 3 milliseconds") is None


def test_the_shares_leave_out_kubectl_but_keep_its_request() -> None:
    run = {"total_s": 1.0, "worker_s": 0.6, "kubectl_s": 0.08, "patch_request_s": 0.005}
    shares = operator_shares(run)
    assert round(shares["operator_from_answer_s"], 6) == 0.32
    assert round(shares["operator_from_patch_s"], 6) == 0.325
    assert "operator_from_patch_s" not in operator_shares({**run, "patch_request_s": None})
