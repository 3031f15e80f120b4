"""A spec change in a field the pod is built from replaces the pod, never two at once."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.conftest import Cluster, OperatorProcess, stage_manifest, wait_for

pytestmark = [pytest.mark.timeout(600)]


def test_template_change_replaces_the_pod_and_the_stage_wakes_again(
    cluster: Cluster, operator: OperatorProcess, tiny_models: dict[str, Path], gpu_node: str
) -> None:
    manifest = stage_manifest("ar", "ar", tiny_models, gpu_node, group="grepl")
    cluster.apply(manifest)
    wait_for("ar Active", lambda: cluster.state("ar") == "Active", 180)
    old = cluster.pod("ar")
    assert old is not None
    old_uid = old["metadata"]["uid"]
    old_hash = old["metadata"]["annotations"]["omnistage.io/pod-spec-hash"]

    manifest["spec"]["template"]["env"] = [{"name": "DEMO_SETTING", "value": "2"}]
    cluster.apply(manifest)

    def replaced() -> bool:
        pod = cluster.pod("ar")
        return pod is not None and pod["metadata"]["uid"] != old_uid

    wait_for("a new pod for ar", replaced, 180)
    new = cluster.pod("ar")
    assert new is not None
    assert new["metadata"]["annotations"]["omnistage.io/pod-spec-hash"] != old_hash
    env = {e["name"]: e.get("value") for e in new["spec"]["containers"][0]["env"]}
    assert env["DEMO_SETTING"] == "2"
    wait_for("ar Active again", lambda: cluster.state("ar") == "Active", 180)
    report = cluster.worker_status("ar")
    assert report is not None and report.last_ack is not None
    assert report.last_ack.op == "wake" and report.last_ack.ok  # woken by the operator's ACK path
    cluster.reasons_include("ar", {"PodOutdated", "PodReplaced"})
