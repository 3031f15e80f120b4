"""``spec.model.source`` on localnode: the init container fetches the tiny model from a local
hub that speaks the Hugging Face Hub's protocol (or from a local S3-protocol server that checks
signatures, with the key pair from a Secret), the stage serves it, and a replaced pod finds it
in the volume (a hostPath standing in for a PersistentVolumeClaim) and downloads nothing. A
wrong secret shows as the store's SignatureDoesNotMatch on the pod; fixing the Secret lets the
init container's next run through.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import Cluster, OperatorProcess, stage_manifest, wait_for
from tests.worker.hub_server import LocalHub
from tests.worker.s3_server import LocalS3

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

        downloads, listings = hub.hits["cdn"], hub.hits["api"]
        _replace_pod(cluster, "fetched")
        assert hub.hits["api"] > listings  # the new pod asked which commit is current
        assert hub.hits["cdn"] == downloads  # and found it in the volume


def _replace_pod(cluster: Cluster, stage: str) -> None:
    """Delete the stage's pod and wait for it Active on a new one."""
    old_uid = (cluster.pod(stage) or {})["metadata"]["uid"]
    cluster.cp.kubectl("delete", "pod", f"{stage}-worker", "-n", cluster.namespace,
                       "--wait=false")  # fmt: skip

    def replaced_and_active() -> bool:
        current = cluster.pod(stage)
        return bool(
            current and current["metadata"]["uid"] != old_uid and cluster.state(stage) == "Active"
        )

    wait_for(f"{stage} Active on a new pod", replaced_and_active, 240)


def test_s3_model_is_fetched_signed_once_and_survives_pod_replacement(
    cluster: Cluster,
    operator: OperatorProcess,
    tiny_models: dict[str, Path],
    gpu_node: str,
    tmp_path: Path,
) -> None:
    volume = tmp_path / "models-volume"
    volume.mkdir()
    with LocalS3() as s3:
        count = s3.put_dir("org/tiny-llama", tiny_models["ar"])
        secret: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "store-keys"},
            "stringData": {
                "AWS_ACCESS_KEY_ID": s3.keys.access_key_id,
                "AWS_SECRET_ACCESS_KEY": "not-the-secret",
            },
        }
        cluster.apply(secret)
        manifest = stage_manifest("from-s3", "ar", tiny_models, gpu_node, group="gs3")
        manifest["spec"]["model"] = {
            "path": f"{volume}/tiny-llama",
            "mountPath": str(volume),
            "volume": {"hostPath": {"path": str(volume), "type": "Directory"}},
            "source": {
                "s3": {
                    "endpoint": s3.url,
                    "bucket": s3.bucket,
                    "prefix": "org/tiny-llama",
                    "pathStyle": True,
                    "credentialsSecret": {"name": "store-keys"},
                }
            },
        }
        cluster.apply(manifest)

        def refused() -> bool:  # the store's verdict, on the pod where a user looks
            statuses = ((cluster.pod("from-s3") or {}).get("status") or {}).get(
                "initContainerStatuses"
            ) or [{}]
            ended = [statuses[0].get("state", {}), statuses[0].get("lastState", {})]
            return any(
                "SignatureDoesNotMatch" in (e.get("terminated") or {}).get("message", "")
                for e in ended
            )

        wait_for("the wrong secret refused by the store", refused, 120)
        assert cluster.state("from-s3") != "Active"
        secret["stringData"]["AWS_SECRET_ACCESS_KEY"] = s3.keys.secret_access_key
        cluster.apply(secret)  # fixed: the init container's next run signs right
        wait_for("from-s3 Active", lambda: cluster.state("from-s3") == "Active", 240)
        listings, downloads = s3.gets()
        assert downloads == count  # every object once, each request signed and accepted
        assert (volume / "tiny-llama" / "config.json").read_bytes() == (
            tiny_models["ar"] / "config.json"
        ).read_bytes()
        (init,) = (cluster.pod("from-s3") or {})["status"]["initContainerStatuses"]
        assert init["name"] == "omnistage-model"
        assert init["state"]["terminated"]["exitCode"] == 0

        _replace_pod(cluster, "from-s3")
        assert s3.gets() == (listings + 1, downloads)  # listed again, nothing downloaded
