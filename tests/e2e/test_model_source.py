"""``spec.model.source`` on localnode: the init container fetches the tiny model from a local
hub that speaks the Hugging Face Hub's protocol, the stage serves it, and a replaced pod finds
it in the volume (a hostPath standing in for a PersistentVolumeClaim) and downloads nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.conftest import Cluster, OperatorProcess, stage_manifest, wait_for
from tests.worker.hub_server import LocalHub

pytestmark = [pytest.mark.timeout(600)]
REPO = "tiny-org/tiny-llama"


def test_model_is_fetched_once_and_survives_pod_replacement(
    cluster: Cluster,
    operator: OperatorProcess,
    tiny_models: dict[str, Path],
    gpu_node: str,
    tmp_path: Path,
) -> None:
    volume = tmp_path / "models-volume"  # what a PVC would keep across pods
    volume.mkdir()
    with LocalHub({REPO: tiny_models["ar"]}) as hub:
        manifest = stage_manifest("fetched", "ar", tiny_models, gpu_node, group="gsource")
        manifest["spec"]["model"] = {
            "path": f"{volume}/{REPO}",
            "mountPath": str(volume),
            "volume": {"hostPath": {"path": str(volume), "type": "Directory"}},
            "source": {"hub": {"url": hub.url, "repo": REPO}},
        }
        cluster.apply(manifest)
        wait_for("fetched Active", lambda: cluster.state("fetched") == "Active", 240)
        files = [p for p in tiny_models["ar"].rglob("*") if p.is_file()]
        assert hub.hits["cdn"] == len(files)
        assert (volume / REPO / "config.json").read_bytes() == (
            tiny_models["ar"] / "config.json"
        ).read_bytes()
        pod = cluster.pod("fetched") or {}
        (init,) = pod["status"]["initContainerStatuses"]
        assert init["name"] == "omnistage-model"
        assert init["state"]["terminated"]["exitCode"] == 0

        old_uid = pod["metadata"]["uid"]
        downloads, listings = hub.hits["cdn"], hub.hits["api"]
        cluster.cp.kubectl("delete", "pod", "fetched-worker", "-n", cluster.namespace,
                           "--wait=false")  # fmt: skip

        def replaced_and_active() -> bool:
            current = cluster.pod("fetched")
            return bool(
                current
                and current["metadata"]["uid"] != old_uid
                and cluster.state("fetched") == "Active"
            )

        wait_for("fetched Active on a new pod", replaced_and_active, 240)
        assert hub.hits["api"] > listings  # the new pod asked which commit is current
        assert hub.hits["cdn"] == downloads  # and found it in the volume
