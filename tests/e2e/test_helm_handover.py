"""A full hand-over with the operator acting as the chart's ServiceAccount, not the admin.

The chart is installed with RBAC limited to the stage namespace (the narrowest scope) and its
generated worker token. The real operator runs as a process with a token of the chart's
ServiceAccount and the chart's token Secret, as the chart's pod would; localnode runs the
workers. Two tiny stages of one group on a one-GPU node hand the GPU over: this proves the
chart's RBAC (and the worker-token guard) leave the operator everything it needs.
"""

from __future__ import annotations

import base64
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster.controlplane import ControlPlane
from tests.e2e.conftest import (
    OPERATOR,
    WAKE_MARGIN,
    Cluster,
    OperatorProcess,
    stage_manifest,
    wait_for,
)
from tests.e2e.test_helm_support import (
    InstalledRelease,
    get_as,
    install_chart,
    lease_path,
    operator_kubeconfig,
    uninstall_chart,
    worker_token,
    worker_token_file,
)

pytestmark = [pytest.mark.timeout(600)]


class ChartOperator(OperatorProcess):
    """The operator process with the chart's identity and worker token."""

    def __init__(
        self, cp: ControlPlane, release: InstalledRelease, namespace: str, workdir: Path
    ) -> None:
        super().__init__(cp, namespace, workdir)
        self.kubeconfig = operator_kubeconfig(cp, release)
        self.token_file = worker_token_file(cp, release, workdir)
        self.release = release

    def start(self) -> None:
        # As in the chart's pod: the Lease (named after the release) in the release namespace.
        env = {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "PYTHONUNBUFFERED": "1",
            "POD_NAMESPACE": self.release.namespace,
            "OMNISTAGE_LEASE_NAME": self.release.fullname,
        }
        argv = [
            OPERATOR,
            f"--namespace={self.namespace}",
            f"--worker-token-file={self.token_file}",
            f"--metrics-port={self.metrics_port}",
            f"--liveness-port={self.liveness_port}",
            f"--wake-margin-bytes={WAKE_MARGIN}",
        ]
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        wait_for("operator liveness endpoint", self._healthy, 60)


@pytest.fixture
def chart_release(omnistage_crd: ControlPlane, namespace: str) -> Iterator[InstalledRelease]:
    """The chart, serving only ``namespace`` with namespaced RBAC."""
    cp = omnistage_crd
    release = install_chart(
        cp, {"rbac": {"scope": "Namespaced"}, "watch": {"namespaces": [namespace]}}
    )
    yield release
    uninstall_chart(cp, release)
    cp.kubectl("delete", "secret", release.token_secret, "-n", release.namespace, check=False)
    cp.delete_namespace(release.namespace)


def test_handover_under_the_chart_service_account(
    cluster: Cluster,
    chart_release: InstalledRelease,
    tiny_models: dict[str, Path],
    gpu_node: str,
    tmp_path: Path,
) -> None:
    op = ChartOperator(cluster.cp, chart_release, cluster.namespace, tmp_path)
    op.start()
    try:
        cluster.apply(stage_manifest("ar", "ar", tiny_models, gpu_node, state="Active"))
        cluster.apply(stage_manifest("sd", "sd", tiny_models, gpu_node, state="Asleep"))
        wait_for("ar Active", lambda: cluster.state("ar") == "Active", 180)
        wait_for("sd Asleep", lambda: cluster.state("sd") == "Asleep", 60)

        cluster.patch_state("sd", "Active")
        wait_for("sd Active", lambda: cluster.state("sd") == "Active", 120)
        ar, sd = cluster.status("ar"), cluster.status("sd")
        assert ar["state"] == "Waiting" and ar["waitingFor"] == ["sd"]
        assert (ar["lastAck"]["op"], ar["lastAck"]["ok"]) == ("sleep", True)
        assert ar["lastAck"]["freedBytes"] > 0
        assert (sd["lastAck"]["op"], sd["lastAck"]["ok"]) == ("wake", True)

        # The operator copied the chart's token for the workers, under the guard.
        secret = cluster.cp.get_json(
            "secret", "omnistage-worker-token", namespace=cluster.namespace
        )
        assert secret["type"] == "Opaque"
        copied = base64.b64decode(secret["data"]["token"]).decode()
        assert copied == worker_token(cluster.cp, chart_release)
        # Transitions were recorded as Events by the operator's identity.
        cluster.reasons_include("ar", {"Slept"})

        log = op.log.read_text(errors="replace")
        assert "Forbidden" not in log and " 403" not in log, op.tail()
        # It led through the chart's Lease grants: the Lease names it, with Events on it.
        lease = cluster.cp.get_json(
            "lease", chart_release.fullname, namespace=chart_release.namespace
        )
        assert lease["spec"]["holderIdentity"] and lease["spec"]["leaseTransitions"] >= 1
        assert "leadership acquired" in log
        # Its Lease requests went through the chart's FlowSchema (the leader-election level).
        schema = cluster.cp.get_json("flowschema", f"{chart_release.fullname}-leader-election")
        _, r = get_as(op.kubeconfig, lease_path(chart_release))
        assert r.status_code == 200
        assert r.headers["X-Kubernetes-PF-FlowSchema-UID"] == schema["metadata"]["uid"]
        assert copied not in log, "the operator logged the worker token"
    finally:
        op.stop()
        print(f"--- operator log tail ---\n{op.tail()}")
