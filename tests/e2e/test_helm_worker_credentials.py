"""workerCredentials.mode=kubernetes end to end: the chart's objects and nothing else let the
operator, acting as the chart's ServiceAccount and presenting that account's token for the
audience omnistage-worker (what the chart's projected volume holds), hand the GPU over between
two stages whose workers, as the chart's ServiceAccount omnistage-worker, review it."""

from __future__ import annotations

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
    install_chart,
    operator_kubeconfig,
    uninstall_chart,
)

pytestmark = [pytest.mark.timeout(600)]


class IdentityOperator(OperatorProcess):
    """The operator as the chart's pod runs it in kubernetes mode."""

    def __init__(
        self, cp: ControlPlane, release: InstalledRelease, namespace: str, workdir: Path
    ) -> None:
        super().__init__(cp, namespace, workdir)
        self.kubeconfig = operator_kubeconfig(cp, release)
        self.release = release
        self.identity_file = workdir / "identity-token"
        token = cp.kubectl(
            "create", "token", release.service_account, "-n", release.namespace,
            "--audience=omnistage-worker",
        ).stdout.strip()  # fmt: skip
        self.identity_file.write_text(token)

    def start(self) -> None:
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
            f"--worker-identity-token-file={self.identity_file}",
            f"--metrics-port={self.metrics_port}",
            f"--liveness-port={self.liveness_port}",
            f"--wake-margin-bytes={WAKE_MARGIN}",
        ]
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        wait_for("operator liveness endpoint", self._healthy, 60)


@pytest.fixture
def kube_release(omnistage_crd: ControlPlane, namespace: str) -> Iterator[InstalledRelease]:
    cp = omnistage_crd
    release = install_chart(
        cp,
        {
            "rbac": {"scope": "Namespaced"},
            "watch": {"namespaces": [namespace]},
            "workerCredentials": {"mode": "kubernetes"},
        },
    )
    yield release
    uninstall_chart(cp, release)
    cp.delete_namespace(release.namespace)


def test_handover_with_kubernetes_issued_credentials(
    cluster: Cluster,
    kube_release: InstalledRelease,
    tiny_models: dict[str, Path],
    gpu_node: str,
    tmp_path: Path,
) -> None:
    cp = cluster.cp
    assert kube_release.token_secret == ""  # no shared token rendered
    chart_secrets = cp.get_json("secrets", namespace=kube_release.namespace)["items"]
    assert not any(s["metadata"]["name"].endswith("worker-token") for s in chart_secrets)
    op = IdentityOperator(cp, kube_release, cluster.namespace, tmp_path)
    op.start()
    try:
        cluster.apply(stage_manifest("ar", "ar", tiny_models, gpu_node, state="Active"))
        cluster.apply(stage_manifest("sd", "sd", tiny_models, gpu_node, state="Asleep"))
        wait_for("ar Active", lambda: cluster.state("ar") == "Active", 180)
        wait_for("sd Asleep", lambda: cluster.state("sd") == "Asleep", 60)
        cluster.patch_state("sd", "Active")
        wait_for("sd Active", lambda: cluster.state("sd") == "Active", 120)
        ar, sd = cluster.status("ar"), cluster.status("sd")
        assert (ar["lastAck"]["op"], ar["lastAck"]["ok"]) == ("sleep", True)
        assert (sd["lastAck"]["op"], sd["lastAck"]["ok"]) == ("wake", True)

        pod = cluster.pod("sd") or {}
        assert pod["spec"]["serviceAccountName"] == "omnistage-worker"
        assert kube_release.user in pod["spec"]["containers"][0]["args"]
        secrets = cp.get_json("secrets", namespace=cluster.namespace)["items"]
        assert "omnistage-worker-token" not in {s["metadata"]["name"] for s in secrets}
        log = op.log.read_text(errors="replace")
        assert "Forbidden" not in log and " 403" not in log, op.tail()
        assert op.identity_file.read_text() not in log
    finally:
        op.stop()
        print(f"--- operator log tail ---\n{op.tail()}")
