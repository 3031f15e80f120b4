"""The worker image in a real container on the real node: kubelet gRPC probe, then a Generate.

A tiny causal LM (built here from a config, nothing downloaded) is mounted read-only by
hostPath; the worker runs as the image's user 65532 with a read-only root filesystem and no
capabilities; the kubelet's own gRPC readiness probe must pass, then a client on the host calls
Generate on the pod IP through the CNI bridge. Then the chart's operator (``helm install`` on
the node) hands over between a tiny AR and a tiny diffusion stage whose workers run in
containers there, in a namespace enforcing the ``restricted`` Pod Security Standard: each
stage claims the node's simulated GPU through DRA (the group's ResourceClaim, prepared by the
node's DRA plugin, reaching the containers through CDI), the model comes from a local
PersistentVolume (no hostPath), the device lists the workers by their host pids, and the
chart's worker TLS is on (the kubelet probes the workers' plaintext health port). Needs
``make images`` (the worker image) and the prerequisites of test_realnode.py; not in CI
(marker ``worker_image``: the image is 5.5 GB).
"""

from __future__ import annotations

import asyncio
import base64
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from omnistage.worker.v1 import (
    inference_service_pb2,
    inference_service_pb2_grpc,
    sleep_service_pb2,
    sleep_service_pb2_grpc,
)
from tests.cluster.build import BuildError, find_kubelet, find_node_binary
from tests.cluster.controlplane import ControlPlane
from tests.cluster.podwait import is_ready, wait_pod
from tests.e2e.conftest import wait_for
from tests.node.chart import enforce_restricted, install_on_node, operator_pod
from tests.node.gpuconfig import NodeGpus
from tests.node.images import IMAGES, PAUSE, archive_path
from tests.node.nodegpus import gpu_node_args
from tests.node.realnode import RealNode
from tests.worker.test_operator_tls import issue
from tests.worker.tiny_models import build_causal_lm, build_diffusion_pipeline

pytestmark = [pytest.mark.cluster, pytest.mark.node, pytest.mark.worker_image]
WORKER = IMAGES["worker"]
PORT = 50051
HEALTH_PORT = 50052  # the worker's plaintext grpc.health.v1 port under TLS (the chart's default)
INFERENCE_SERVICE = "omnistage.worker.v1.InferenceService"


@pytest.fixture(scope="module")
def models() -> Iterator[Path]:
    """A world-readable directory holding the tiny model (the container's user is 65532)."""
    root = Path(tempfile.mkdtemp(prefix="omnistage-node-models-"))
    build_causal_lm(root / "ar")
    build_diffusion_pipeline(root / "sd")
    for directory, _dirs, files in os.walk(root):
        os.chmod(directory, 0o755)
        for name in files:
            os.chmod(Path(directory) / name, 0o644)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def worker_node(control_plane: ControlPlane) -> Iterator[RealNode]:
    try:
        kubelet, proxy = find_kubelet(), find_node_binary("kube-proxy")
        gpu_args = gpu_node_args(NodeGpus(count=1, memory=GPU_BYTES))
    except BuildError as exc:
        pytest.fail(str(exc), pytrace=False)
    archives = (archive_path(PAUSE), archive_path(WORKER), archive_path(IMAGES["operator"]))
    for archive in archives:
        if not archive.is_file():
            pytest.fail(f"{archive} is missing: run `make images`", pytrace=False)
    with RealNode(control_plane, kubelet, archives, kube_proxy=proxy, **gpu_args) as node:
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


# One simulated GPU (the localnode e2e tests' size): the two tiny stages fit one at a time.
GPU_BYTES = 1_100_000
WAKE_MARGIN = 16 * 1024
MODELS_PV = "omnistage-node-models"


def _models_volume(node: str, models: Path, namespace: str) -> list[dict[str, Any]]:
    """A local PersistentVolume on ``node`` holding the models, and its claim: the model
    volume a pod under ``restricted`` may use (hostPath it may not)."""
    return [
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": MODELS_PV},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadWriteOnce"],
                "persistentVolumeReclaimPolicy": "Retain",
                "storageClassName": "",
                "local": {"path": str(models)},
                "claimRef": {"namespace": namespace, "name": "models"},
                "nodeAffinity": {
                    "required": {
                        "nodeSelectorTerms": [
                            {
                                "matchExpressions": [
                                    {
                                        "key": "kubernetes.io/hostname",
                                        "operator": "In",
                                        "values": [node],
                                    }
                                ]
                            }
                        ]
                    }
                },
            },
        },
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": "models", "namespace": namespace},
            "spec": {
                "accessModes": ["ReadWriteOnce"],
                "storageClassName": "",
                "volumeName": MODELS_PV,
                "resources": {"requests": {"storage": "1Gi"}},
            },
        },
    ]


def _sign(directory: Path, ca: Path, ca_key: Path, dns_name: str) -> tuple[Path, Path]:
    """A server certificate for ``dns_name`` signed by the CA (openssl): (crt, key)."""
    directory.mkdir(parents=True, exist_ok=True)
    key, csr, crt = directory / "tls.key", directory / "tls.csr", directory / "tls.crt"
    ext = directory / "ext.cnf"
    ext.write_text(f"subjectAltName=DNS:{dns_name}\nextendedKeyUsage=serverAuth\n")
    for args in (
        ["req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr)],
        ["x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key)],
    ):
        if args[0] == "req":
            args += ["-subj", f"/CN={dns_name}"]
        else:
            args += ["-CAcreateserial", "-days", "1", "-out", str(crt), "-extfile", str(ext)]
        subprocess.run(["openssl", *args], check=True, capture_output=True)
    return crt, key


def _worker_tls(directory: Path, stages: str) -> tuple[Path, dict[str, dict[str, Any]]]:
    """A test CA and, per stage, the ``kubernetes.io/tls`` Secret of a certificate naming its
    Service (``<stage>-worker.<namespace>.svc``), as a cert-manager Certificate writes it."""
    (directory / "ar").mkdir(parents=True)
    ca, crt, key = issue(directory / "ar", f"ar-worker.{stages}.svc")
    pairs = {"ar": (crt, key)}
    ca_key = directory / "ar" / "ca.key"
    pairs["sd"] = _sign(directory / "sd", ca, ca_key, f"sd-worker.{stages}.svc")
    secrets = {
        name: {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": f"{name}-worker-tls", "namespace": stages},
            "type": "kubernetes.io/tls",
            "data": {
                "tls.crt": base64.b64encode(c.read_bytes()).decode(),
                "tls.key": base64.b64encode(k.read_bytes()).decode(),
            },
        }
        for name, (c, k) in pairs.items()
    }
    return ca, secrets


def _stage(name: str, kind: str, node: str, state: str) -> dict[str, Any]:
    runner, backend = {"ar": ("AR", "Transformers"), "sd": ("Diffusion", "Diffusers")}[kind]
    return {
        "apiVersion": "omnistage.io/v1alpha1",
        "kind": "OmniStage",
        "metadata": {"name": name},
        "spec": {
            "runner": runner,
            "backend": backend,
            "image": WORKER.ref,
            "model": {
                "path": f"/models/{kind}",
                "mountPath": "/models",
                "volume": {"persistentVolumeClaim": {"claimName": "models", "readOnly": True}},
            },
            "state": state,
            "colocation": {"group": "g"},
            "gpus": 1,
            "worker": {
                "device": "cpu",
                "dtype": "float32",
                "tls": {"secretName": f"{name}-worker-tls"},
            },
            "template": {"nodeSelector": {"kubernetes.io/hostname": node}},
        },
    }


def _host_pids(node: RealNode, pods: list[dict[str, Any]]) -> dict[str, int]:
    """Stage -> the host pid of its pod's (first) container's process, as containerd knows it."""
    tasks = {}
    for line in node.ctr("tasks", "ls").splitlines()[1:]:
        fields = line.split()
        tasks[fields[0]] = int(fields[1])
    out = {}
    for pod in pods:
        container = pod["status"]["containerStatuses"][0]["containerID"].split("//", 1)[1]
        out[pod["metadata"]["labels"]["omnistage.io/stage"]] = tasks[container]
    return out


def _plaintext_status(target: str) -> bool:
    """Whether a plaintext GetStatus on ``target`` gets any answer (even a refusal)."""

    async def call() -> bool:
        async with grpc.aio.insecure_channel(target) as channel:
            stub = sleep_service_pb2_grpc.SleepServiceStub(channel)
            try:
                await stub.GetStatus(sleep_service_pb2.GetStatusRequest(), timeout=5)
            except grpc.aio.AioRpcError as exc:
                return exc.code() not in (
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                )
            return True

    return asyncio.run(call())


def test_chart_hands_over_between_worker_containers(
    worker_node: RealNode, control_plane: ControlPlane, models: Path, tmp_path: Path
) -> None:
    """helm install on the node, two stages whose workers run in containers, a hand-over;
    the chart's worker TLS on: the operator orders the workers over TLS, the kubelet's gRPC
    probes go to their plaintext health port."""
    cp = control_plane
    release_ns = cp.create_namespace("omnistage-system")
    stages = cp.create_namespace("stages")
    for ns in (release_ns, stages):
        enforce_restricted(cp, ns)
    cp.apply(_models_volume(worker_node.name, models, stages))
    ca, tls_secrets = _worker_tls(tmp_path, stages)
    cp.apply(list(tls_secrets.values()))
    cp.kubectl("create", "secret", "generic", "worker-ca", f"--from-file=ca.crt={ca}",
               "-n", release_ns)  # fmt: skip
    values = {
        "operator": {"extraArgs": [f"--wake-margin-bytes={WAKE_MARGIN}"]},
        "workerTLS": {"caSecret": "worker-ca"},
    }
    release = install_on_node(cp, worker_node.name, release_ns, [stages], extra=values)

    def state(name: str) -> str | None:
        status = cp.get_json("omnistage", name, namespace=stages).get("status") or {}
        value: str | None = status.get("state")
        return value

    try:
        operator_pod(cp, release, worker_node.container_logs)
        cp.apply(_stage("ar", "ar", worker_node.name, "Active"), namespace=stages)
        cp.apply(_stage("sd", "sd", worker_node.name, "Asleep"), namespace=stages)
        wait_for("ar Active", lambda: state("ar") == "Active", 300)
        wait_for("sd Asleep", lambda: state("sd") == "Asleep", 120)
        cp.kubectl(
            "patch",
            "omnistage",
            "sd",
            "-n",
            stages,
            "--type",
            "merge",
            "-p",
            '{"spec":{"state":"Active"}}',
        )
        wait_for("sd Active", lambda: state("sd") == "Active", 300)
        ar = cp.get_json("omnistage", "ar", namespace=stages)["status"]
        assert ar["state"] == "Waiting" and ar["waitingFor"] == ["sd"], ar
        assert (ar["lastAck"]["op"], ar["lastAck"]["ok"]) == ("sleep", True), ar
        pods = [cp.get_json("pod", f"{n}-worker", namespace=stages) for n in ("ar", "sd")]
        for pod in pods:  # the workers ran in containers on the node, never restarted
            assert pod["spec"]["nodeName"] == worker_node.name
            assert pod["status"]["containerStatuses"][0]["restartCount"] == 0
            volumes = pod["spec"]["volumes"]
            assert not [v for v in volumes if "hostPath" in v], volumes
            assert pod["spec"]["resourceClaims"], "the GPU comes from the group's claim"
            (container,) = pod["spec"]["containers"]
            assert "--tls-cert" in container["args"], container["args"]
            assert container["readinessProbe"]["grpc"]["port"] == HEALTH_PORT
        # the control port answers TLS only: a plaintext call gets nothing
        assert not _plaintext_status(f"{pods[1]['status']['podIP']}:{PORT}")
        # the device lists both workers by their host pids (as NVML does in containers)
        gpu = worker_node.gpu()
        host_pids = _host_pids(worker_node, pods)
        assert set(gpu.live()) == set(host_pids.values()), gpu.live()

        def figures_match() -> bool:
            """Each worker's own figures are its host-pid record's; free is the device's."""
            snap = gpu.snapshot()
            for name, pid in host_pids.items():
                memory = cp.get_json("omnistage", name, namespace=stages)["status"]["memory"]
                if (memory["usedBytes"], memory["freeBytes"]) != (snap.procs[pid].used, snap.free):
                    return False
            return True

        wait_for("the workers' figures = the device's, seen from the host", figures_match, 60)
        assert ar["lastAck"]["freedBytes"] > 0
        cp.kubectl("delete", "omnistage", "ar", "sd", "-n", stages, "--timeout=120s")
    finally:
        cp.helm("uninstall", release.name, "--namespace", release_ns, "--wait")
        unfinalize = ["--type", "merge", "-p", '{"metadata":{"finalizers":null}}']
        for name in ("ar", "sd"):
            cp.kubectl("patch", "omnistage", name, "-n", stages, *unfinalize, check=False)
        for ns in (stages, release_ns):
            cp.delete_namespace(ns)
        cp.kubectl("delete", "pv", MODELS_PV, "--ignore-not-found")
