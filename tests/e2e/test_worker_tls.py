"""A stage whose worker serves TLS only: the operator drives it over TLS, the probes pass.

The certificate (a test CA's, naming ``<stage>-worker.<namespace>.svc``) sits in a
``kubernetes.io/tls`` Secret named by ``spec.worker.tls.secretName``, as a cert-manager
Certificate would write it (examples/tls/). localnode runs the pod with the kubelet's
plaintext gRPC probes; before ``--health-port`` they hit the TLS port and failed.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from tests.e2e.conftest import Cluster, OperatorProcess, stage_manifest, wait_for
from tests.worker.test_operator_tls import issue

pytestmark = [pytest.mark.timeout(600)]


def _tls_secret(name: str, crt: Path, key: Path) -> dict[str, object]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name},
        "type": "kubernetes.io/tls",
        "data": {
            "tls.crt": base64.b64encode(crt.read_bytes()).decode(),
            "tls.key": base64.b64encode(key.read_bytes()).decode(),
        },
    }


def test_tls_stage_is_probed_in_plaintext_and_ordered_over_tls(
    cluster: Cluster, tiny_models: dict[str, Path], gpu_node: str, tmp_path: Path
) -> None:
    ca, crt, key = issue(tmp_path, f"secure-worker.{cluster.namespace}.svc")
    cluster.apply(_tls_secret("secure-worker-tls", crt, key))
    workdir = tmp_path / "operator"
    workdir.mkdir()
    operator = OperatorProcess(cluster.cp, cluster.namespace, workdir)
    operator.extra = ["--worker-tls-ca", str(ca)]
    operator.start()
    try:
        manifest = stage_manifest("secure", "ar", tiny_models, gpu_node, group="gtls")
        manifest["spec"]["worker"]["tls"] = {"secretName": "secure-worker-tls"}
        cluster.apply(manifest)
        wait_for("secure Active", lambda: cluster.state("secure") == "Active", 180)

        pod = cluster.pod("secure") or {}
        (worker,) = pod["spec"]["containers"]
        assert worker["readinessProbe"]["grpc"]["port"] == 50052
        assert worker["livenessProbe"]["grpc"]["port"] == 50052
        assert "--tls-cert" in worker["args"] and "--health-port" in worker["args"]

        def ready() -> bool:
            conds = (cluster.pod("secure") or {}).get("status", {}).get("conditions") or []
            return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)

        wait_for("the worker pod Ready (plaintext probes)", ready, 120)
        # The control channel is TLS only: a plaintext GetStatus gets nothing.
        assert cluster.worker_status("secure") is None

        cluster.patch_state("secure", "Asleep")
        wait_for("secure Asleep", lambda: cluster.state("secure") == "Asleep", 180)
        ack = cluster.status("secure").get("lastAck") or {}
        assert ack.get("op") == "sleep" and ack.get("ok") is True, json.dumps(ack)
        restarts = pod["status"].get("containerStatuses", [{}])[0].get("restartCount", 0)
        assert restarts == 0
        assert (cluster.pod("secure") or {})["metadata"]["uid"] == pod["metadata"]["uid"]
    finally:
        operator.stop()
        print(f"--- operator log tail ---\n{operator.tail()}")
