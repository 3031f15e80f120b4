"""Fixtures for the operator's end-to-end tests on the local control plane.

``omnistage_crd`` installs the CRD; ``tiny_models`` builds a tiny Llama and a tiny diffusers
pipeline from configs (nothing downloaded); ``gpu`` starts a localnode node with ONE simulated
GPU of ``CAPACITY`` bytes (driver reserve, a context per process, activations while serving:
``tests/fakegpu``), so the tiny diffusion stage fits only alone (``gpu_node``: its name);
``operator`` runs the real ``omnistage-operator`` as a subprocess with the admin kubeconfig.
Helpers poll for conditions with deadlines and read the workers' own GetStatus over gRPC.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from omnistage_operator.decisions.facts import WorkerReport
from omnistage_operator.decisions.handover import WorkerUnavailable
from omnistage_operator.k8s.worker_client import WorkerClient
from tests.cluster.controlplane import ControlPlane
from tests.cluster.localnode import LocalNodes
from tests.cluster.procs import die_with_parent, tail_log, terminate, wait_tied
from tests.worker.tiny_models import build_causal_lm, build_diffusion_pipeline

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "crds" / "omnistages.omnistage.io.yaml"
OPERATOR = str(Path(sys.executable).parent / "omnistage-operator")
# Accounted weights: tiny Llama ~81 KiB, tiny SD ~1014 KiB. One SD fits, SD + anything does not.
CAPACITY = 1_100_000
WAKE_MARGIN = 16 * 1024
TOKEN = "e2e-worker-token"
T = TypeVar("T")


def wait_for(what: str, check: Callable[[], T | None], timeout: float = 120.0) -> T:
    """Poll ``check`` until it returns a truthy value; fail naming ``what`` on timeout."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def omnistage_crd(control_plane: ControlPlane) -> ControlPlane:
    control_plane.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD))
    control_plane.wait_crd_established(CRD.stem)
    return control_plane


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("e2e-models")
    return {"ar": build_causal_lm(root / "ar"), "sd": build_diffusion_pipeline(root / "sd")}


@dataclass
class Gpu:
    """One localnode node with one simulated GPU: its name, and the harness (faults, the
    device seen from outside as nvidia-smi would show it)."""

    nodes: LocalNodes
    node: str
    device: str = "gpu-0"

    def snapshot(self) -> Any:
        return self.nodes.device_snapshot(self.node, self.device)


@pytest.fixture
def gpu(make_local_nodes: Callable[..., LocalNodes]) -> Gpu:
    """A fresh node with one simulated GPU of ``CAPACITY`` bytes."""
    nodes = make_local_nodes(nodes=1, gpus=1, gpu_memory=CAPACITY)
    return Gpu(nodes, nodes.node_names[0])


@pytest.fixture
def gpu_node(gpu: Gpu) -> str:
    """The name of the ``gpu`` fixture's node."""
    return gpu.node


class OperatorProcess:
    """The real operator as a subprocess."""

    def __init__(
        self, cp: ControlPlane, namespace: str, workdir: Path, kubeconfig: Path | None = None
    ) -> None:
        self.cp = cp
        self.kubeconfig = kubeconfig or cp.kubeconfig
        self.namespace = namespace
        self.workdir = workdir
        self.token_file = workdir / "token"
        self.token_file.write_text(TOKEN)
        self.log = workdir / "operator.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.metrics_port = _free_port()
        self.liveness_port = _free_port()
        self.extra: list[str] = []
        self.executable = OPERATOR
        # How it authenticates to workers (the shared token by default).
        self.auth: list[str] = ["--worker-token-file", str(self.token_file)]

    def start(self) -> None:
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig), "PYTHONUNBUFFERED": "1"}
        argv = [
            self.executable,
            "--namespace", self.namespace,
            *self.auth,
            "--metrics-port", str(self.metrics_port),
            "--liveness-port", str(self.liveness_port),
            "--wake-margin-bytes", str(WAKE_MARGIN),
            *self.extra,
        ]  # fmt: skip
        self.spawn(argv, env)
        wait_for("operator liveness endpoint", self._healthy, 60)

    def spawn(self, argv: list[str], env: dict[str, str]) -> None:
        """Run ``argv`` as this operator's process, logging to ``log``; the kernel kills it
        when this process dies (a test or bench killed, even by SIGKILL, leaves no operator)."""
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                die_with_parent(argv), stdout=log, stderr=subprocess.STDOUT, env=env
            )
        wait_tied(self.proc.pid)

    def _healthy(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"operator exited {self.proc.returncode}:\n{self.tail()}")
        try:
            url = f"http://127.0.0.1:{self.liveness_port}/healthz"
            with urllib.request.urlopen(url, timeout=1) as resp:
                return bool(resp.status == 200)
        except OSError:
            return False

    def metrics(self) -> str:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:
            return str(resp.read().decode())

    def kill(self) -> None:
        """SIGKILL: no cleanup, as a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None:
            terminate(self.proc)

    def tail(self, n: int = 60) -> str:
        return tail_log(self.log, n)


SERIAL = "--no-overlapped-handover"  # a test of the serial promise: the sleep's ACK, then the wake


@pytest.fixture
def operator(
    omnistage_crd: ControlPlane, namespace: str, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[OperatorProcess]:
    """The operator for one test; ``@pytest.mark.operator_args(...)`` adds its flags."""
    op = OperatorProcess(omnistage_crd, namespace, tmp_path)
    marker = request.node.get_closest_marker("operator_args")
    op.extra = [str(arg) for arg in marker.args] if marker else []
    op.start()
    yield op
    op.stop()
    print(f"--- operator log tail ---\n{op.tail()}")


@dataclass
class Cluster:
    """kubectl helpers for one namespace."""

    cp: ControlPlane
    namespace: str

    def apply(self, manifest: dict[str, Any]) -> None:
        self.cp.apply(manifest, namespace=self.namespace)

    def stage(self, name: str) -> dict[str, Any]:
        return self.cp.get_json("omnistage", name, namespace=self.namespace)

    def status(self, name: str) -> dict[str, Any]:
        return dict(self.stage(name).get("status") or {})

    def state(self, name: str) -> str | None:
        return self.status(name).get("state")

    def patch_state(self, name: str, state: str) -> None:
        self.cp.kubectl(
            "patch", "omnistage", name, "-n", self.namespace, "--type=merge",
            "-p", f'{{"spec":{{"state":"{state}"}}}}',
        )  # fmt: skip

    def exists(self, kind: str, name: str) -> bool:
        res = self.cp.kubectl("get", kind, name, "-n", self.namespace, check=False)
        return res.returncode == 0

    def pod(self, stage: str) -> dict[str, Any] | None:
        res = self.cp.kubectl(
            "get", "pod", f"{stage}-worker", "-n", self.namespace, "-o", "json", check=False
        )
        if res.returncode != 0:
            return None
        import json

        return dict(json.loads(res.stdout))

    def events(self, name: str) -> list[dict[str, Any]]:
        data = self.cp.get_json(
            "events", "--field-selector", f"involvedObject.name={name}", namespace=self.namespace
        )
        return list(data.get("items", []))

    def reasons_include(
        self, name: str, wanted: set[str], timeout: float = 15.0
    ) -> list[dict[str, Any]]:
        """``name``'s Events once their reasons include ``wanted`` (the operator posts Events
        in the background, so an Event may land just after the state it reports)."""

        def found() -> list[dict[str, Any]] | None:
            events = self.events(name)
            return events if wanted <= {e["reason"] for e in events} else None

        return wait_for(f"Events {sorted(wanted)} on {name}", found, timeout)

    def worker_status(self, stage: str) -> WorkerReport | None:
        """The worker's own GetStatus, dialled at its pod IP."""
        pod = self.pod(stage)
        ip = (pod or {}).get("status", {}).get("podIP")
        if not ip:
            return None
        port = stage_port(pod or {})

        async def call() -> WorkerReport | None:
            client = WorkerClient(f"{ip}:{port}", token=TOKEN)
            try:
                return await client.get_status(2.0)
            except WorkerUnavailable:
                return None
            finally:
                await client.close()

        return asyncio.run(call())


def stage_port(pod: dict[str, Any]) -> int:
    for c in pod["spec"]["containers"]:
        for p in c.get("ports", []):
            return int(p["containerPort"])
    return 50051


@pytest.fixture
def cluster(omnistage_crd: ControlPlane, namespace: str) -> Cluster:
    return Cluster(omnistage_crd, namespace)


def stage_manifest(
    name: str,
    kind: str,
    models: dict[str, Path],
    node: str,
    *,
    group: str = "g1",
    state: str = "Active",
    priority: int = 0,
    port: int | None = None,
    sleep_level: int = 1,
    vram_request: str | None = None,
    model_path: str = "/models/m",
    drain_timeout_s: int | None = None,
    worker_args: list[str] | None = None,
) -> dict[str, Any]:
    """An OmniStage for the tiny ``kind`` ("ar" or "sd") model, pinned to ``node`` (no
    ``vram.request`` unless given: the footprint is measured)."""
    runner, backend = {"ar": ("AR", "Transformers"), "sd": ("Diffusion", "Diffusers")}[kind]
    worker: dict[str, Any] = {"device": "cpu"}
    if worker_args:
        worker["args"] = list(worker_args)
    if port is not None:
        worker["port"] = port
    extra: dict[str, Any] = {}
    if vram_request is not None:
        extra["vram"] = {"request": vram_request}
    if drain_timeout_s is not None:
        extra["drainTimeoutSeconds"] = drain_timeout_s
    return {
        "apiVersion": "omnistage.io/v1alpha1",
        "kind": "OmniStage",
        "metadata": {"name": name},
        "spec": {
            **extra,
            "runner": runner,
            "backend": backend,
            "image": "omnistage/worker:e2e",
            "model": {
                "path": model_path,
                "mountPath": "/models/m",
                "volume": {"hostPath": {"path": str(models[kind]), "type": "Directory"}},
            },
            "state": state,
            "sleepLevel": sleep_level,
            "colocation": {"group": group, "priority": priority},
            "gpus": 1,
            "worker": worker,
            "template": {"nodeSelector": {"kubernetes.io/hostname": node}},
        },
    }
