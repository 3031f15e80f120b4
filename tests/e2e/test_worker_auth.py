"""A worker that refuses the operator's token: the stage's status says so; a new pod heals it."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from tests.e2e.conftest import Cluster, OperatorProcess, stage_manifest, wait_for

pytestmark = [pytest.mark.timeout(600)]
ROTATED = "a-rotated-token"


def test_unauthenticated_worker_is_reported_then_replaced(
    cluster: Cluster,
    operator: OperatorProcess,
    tiny_models: dict[str, Path],
    gpu_node: str,
    tmp_path: Path,
) -> None:
    cluster.apply(stage_manifest("ar", "ar", tiny_models, gpu_node, group="gauth"))
    wait_for("ar Active", lambda: cluster.state("ar") == "Active", 180)
    old_uid = (cluster.pod("ar") or {})["metadata"]["uid"]

    # The operator comes back with another token (say, reinstalled); the worker kept the old one.
    operator.stop()
    workdir = tmp_path / "rotated"
    workdir.mkdir()
    rotated = OperatorProcess(cluster.cp, cluster.namespace, workdir)
    rotated.token_file.write_text(ROTATED)
    rotated.start()
    try:

        def ready() -> dict[str, str]:
            conds = {c["type"]: c for c in cluster.status("ar").get("conditions") or []}
            return dict(conds.get("Ready") or {})

        wait_for(
            "Ready=False WorkerUnauthenticated",
            lambda: ready().get("reason") == "WorkerUnauthenticated",
            120,
        )
        assert ready()["status"] == "False"
        assert "UNAUTHENTICATED" in ready()["message"]
        assert ROTATED not in ready()["message"]
        cluster.reasons_include("ar", {"WorkerUnauthenticated"})
        secret = cluster.cp.get_json(
            "secret", "omnistage-worker-token", namespace=cluster.namespace
        )
        assert base64.b64decode(secret["data"]["token"]).decode() == ROTATED

        # A new pod mounts the repaired Secret: the stage comes back under the new token.
        cluster.cp.kubectl("delete", "pod", "ar-worker", "-n", cluster.namespace, "--wait=false")

        def healed() -> bool:
            pod = cluster.pod("ar")
            return bool(
                pod and pod["metadata"]["uid"] != old_uid and cluster.state("ar") == "Active"
            )

        wait_for("ar Active on a new pod", healed, 240)
        assert ready()["reason"] == "WorkerReady"
        assert ROTATED not in rotated.tail(400)
    finally:
        rotated.stop()
