"""The worker image in a real container on the real node: kubelet gRPC probe, then a Generate.

A tiny causal LM (built here from a config, nothing downloaded) is mounted read-only by
hostPath; the worker runs as the image's user 65532 with a read-only root filesystem and no
capabilities; the kubelet's own gRPC readiness probe must pass, then a client on the host calls
Generate on the pod IP through the CNI bridge. Needs ``make images`` (the worker image) and the
prerequisites of test_realnode.py.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from omnistage.worker.v1 import inference_service_pb2, inference_service_pb2_grpc
from tests.cluster.build import BuildError, find_kubelet
from tests.cluster.controlplane import ControlPlane
from tests.cluster.podwait import is_ready, wait_pod
from tests.node.images import IMAGES, PAUSE, archive_path
from tests.node.realnode import RealNode
from tests.worker.tiny_models import build_causal_lm

pytestmark = [pytest.mark.cluster, pytest.mark.node, pytest.mark.worker_image]
WORKER = IMAGES["worker"]
PORT = 50051
INFERENCE_SERVICE = "omnistage.worker.v1.InferenceService"


@pytest.fixture(scope="module")
def models() -> Iterator[Path]:
    """A world-readable directory holding the tiny model (the container's user is 65532)."""
    root = Path(tempfile.mkdtemp(prefix="omnistage-node-models-"))
    build_causal_lm(root / "ar")
    for directory, _dirs, files in os.walk(root):
        os.chmod(directory, 0o755)
        for name in files:
            os.chmod(Path(directory) / name, 0o644)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def worker_node(control_plane: ControlPlane) -> Iterator[RealNode]:
    try:
        kubelet = find_kubelet()
    except BuildError as exc:
        pytest.fail(str(exc), pytrace=False)
    archives = (archive_path(PAUSE), archive_path(WORKER))
    for archive in archives:
        if not archive.is_file():
            pytest.fail(f"{archive} is missing: run `make images`", pytrace=False)
    with RealNode(control_plane, kubelet, archives) as node:
        yield node


def _worker_pod(node: str, models: Path) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "worker"},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": node},
            "automountServiceAccountToken": False,
            "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [
                {
                    "name": "worker",
                    "image": WORKER.ref,
                    "imagePullPolicy": "Never",
                    "args": [
                        "--runner=ar",
                        "--backend=transformers",
                        "--model=/models/ar",
                        "--device=cpu",
                        "--dtype=float32",
                        "--host=0.0.0.0",
                        f"--port={PORT}",
                    ],
                    "env": [{"name": "OMNISTAGE_CPU_THREADS", "value": "1"}],
                    "ports": [{"name": "grpc", "containerPort": PORT}],
                    # Ready once the inference service serves: the model is loaded and awake
                    "readinessProbe": {
                        "grpc": {"port": PORT, "service": INFERENCE_SERVICE},
                        "periodSeconds": 1,
                    },
                    "securityContext": {
                        "allowPrivilegeEscalation": False,
                        "readOnlyRootFilesystem": True,
                        "capabilities": {"drop": ["ALL"]},
                    },
                    "volumeMounts": [
                        {"name": "models", "mountPath": "/models", "readOnly": True},
                        {"name": "tmp", "mountPath": "/tmp"},
                    ],
                }
            ],
            "volumes": [
                {"name": "models", "hostPath": {"path": str(models), "type": "Directory"}},
                {"name": "tmp", "emptyDir": {}},
            ],
        },
    }


def test_worker_image_serves_generate_behind_a_kubelet_grpc_probe(
    worker_node: RealNode, control_plane: ControlPlane, namespace: str, models: Path
) -> None:
    assert WORKER.ref in worker_node.images()
    control_plane.apply(_worker_pod(worker_node.name, models), namespace=namespace)
    pod = wait_pod(control_plane, namespace, "worker", is_ready, "Ready", timeout=300)
    status = pod["status"]["containerStatuses"][0]
    assert status["restartCount"] == 0
    target = f"{pod['status']['podIP']}:{PORT}"

    async def generate() -> Any:
        async with grpc.aio.insecure_channel(target) as channel:
            stub = inference_service_pb2_grpc.InferenceServiceStub(channel)
            request = inference_service_pb2.GenerateRequest(prompt="the cat", max_new_tokens=3)
            return await stub.Generate(request, timeout=120)

    reply = asyncio.run(generate())
    assert len(reply.text.token_ids) == 3
    assert reply.text.text.strip(), reply
