"""Harness for the leader-election tests: operators behind cuttable API proxies, worker probes.

- ``ApiProxy``: a TCP proxy on 127.0.0.1 in front of the API server. ``cut()`` blackholes it
  (connections stay open, bytes are held, new connections are accepted and held too), as a
  network partition does; ``restore()`` lets everything through again.
- ``ElectedOperator``: the real operator process with its API traffic through its own proxy,
  ``POD_NAME`` set (the Lease holder is ``<POD_NAME>_<random>``), short election timings, and
  an optional test-only fault point (below).
- ``WorkerProbe``: the workers' own GetStatus over gRPC (pod IPs cached), with the epoch they
  obeyed, and ``Watcher``, which polls them into a ``holding_log.HoldingLog``: every ACK seen,
  and "did two stages ever hold memory at once?" from the workers' ACK timestamps (the tests
  also watch the simulated GPU from outside with ``test_handover.MemoryWatch``).

The operators run as ``python -m tests.e2e.test_leader_faultpoint`` (the real CLI plus a
test-only fault point, see there).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import httpx
import yaml

from omnistage_operator.decisions.arbiter import WorkerPhase
from omnistage_operator.decisions.facts import (
    report_from_proto,
)
from tests.cluster.controlplane import ControlPlane
from tests.cluster.kubeconfig import auth_context, load_kubeconfig
from tests.e2e.conftest import ROOT, TOKEN, WAKE_MARGIN, OperatorProcess, wait_for
from tests.e2e.holding_log import HoldingLog, Probe
from tests.e2e.test_leader_faultpoint import BUSY_BEFORE_WAKE, STOP_BEFORE_WAKE

LEASE = "omnistage-operator"


class ApiProxy:
    """127.0.0.1:port -> the API server; ``cut``/``restore`` a partition."""

    def __init__(self, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._sock.getsockname()[1])
        self._open = threading.Event()
        self._open.set()
        self._closed = False
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def cut(self) -> None:
        self._open.clear()

    def restore(self) -> None:
        self._open.set()

    def close(self) -> None:
        self._closed = True
        self._open.set()
        self._sock.close()
        with self._lock:
            for c in self._conns:
                with contextlib.suppress(OSError):
                    c.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        self._open.wait()  # a new connection during a cut hangs, as a partition does
        try:
            upstream = socket.create_connection(self.target, timeout=10)
        except OSError:
            client.close()
            return
        upstream.settimeout(None)
        with self._lock:
            self._conns += [client, upstream]
        threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()
        self._pump(upstream, client)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                self._open.wait()  # held, not dropped, while cut
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)


def proxied_kubeconfig(cp: ControlPlane, proxy: ApiProxy, path: Path) -> Path:
    """The admin kubeconfig with its server replaced by the proxy's address."""
    cfg = yaml.safe_load(cp.kubeconfig.read_text())
    for cluster in cfg["clusters"]:
        cluster["cluster"]["server"] = f"https://127.0.0.1:{proxy.port}"
    path.write_text(yaml.safe_dump(cfg))
    path.chmod(0o600)
    return path


class ElectedOperator(OperatorProcess):
    """The operator with election flags, its own API proxy and identity, the fault point."""

    def __init__(
        self,
        cp: ControlPlane,
        namespace: str,
        workdir: Path,
        name: str,
        timing: tuple[float, float, float],
        *,
        stop_before_wake: Path | None = None,
        busy_before_wake: Path | None = None,
    ) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.proxy = ApiProxy(int(cp.server.rsplit(":", 1)[1]))
        super().__init__(cp, namespace, workdir, proxied_kubeconfig(cp, self.proxy, workdir / "kc"))
        self.name = name
        self.stop_before_wake = stop_before_wake
        self.busy_before_wake = busy_before_wake
        lease, renew, retry = timing
        self.extra = [
            f"--lease-duration={lease}",
            f"--renew-deadline={renew}",
            f"--retry-period={retry}",
            "--resync-interval=2",
        ]

    def start(self, wait: bool = True) -> None:
        env = {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "PYTHONUNBUFFERED": "1",
            "POD_NAME": self.name,
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        env.pop(STOP_BEFORE_WAKE, None)
        env.pop(BUSY_BEFORE_WAKE, None)
        if self.stop_before_wake is not None:
            env[STOP_BEFORE_WAKE] = str(self.stop_before_wake)
        if self.busy_before_wake is not None:
            env[BUSY_BEFORE_WAKE] = str(self.busy_before_wake)
        argv = [
            sys.executable, "-m", "tests.e2e.test_leader_faultpoint",
            "--namespace", self.namespace,
            "--worker-token-file", str(self.token_file),
            "--metrics-port", str(self.metrics_port),
            "--liveness-port", str(self.liveness_port),
            "--wake-margin-bytes", str(WAKE_MARGIN),
            *self.extra,
        ]  # fmt: skip
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        if wait:
            wait_for(f"operator {self.name} liveness endpoint", self._healthy, 60)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stopped(self) -> bool:
        """The process is in state T (SIGSTOPped)."""
        try:
            stat = Path(f"/proc/{self.pid}/stat").read_text()
        except OSError:
            return False
        return stat.rsplit(")", 1)[1].split()[0] in ("T", "t")

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.pid, sig)

    def gauge(self, name: str, timeout: float = 1.0) -> float | None:
        """A metric of this process (None when it does not answer)."""
        try:
            url = f"http://127.0.0.1:{self.metrics_port}/metrics"
            with urllib.request.urlopen(url, timeout=timeout) as resp:
                text = resp.read().decode()
        except OSError:
            return None
        for line in text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        return None

    def shutdown(self) -> None:
        self.signal(signal.SIGCONT)
        self.proxy.restore()
        self.stop()
        self.proxy.close()


class LeaseReader:
    """Reads the Lease straight from the API server (admin credentials), fast enough to poll."""

    def __init__(self, cp: ControlPlane, namespace: str, name: str = LEASE) -> None:
        auth = load_kubeconfig(cp.kubeconfig)
        self._client = httpx.Client(verify=auth_context(auth), timeout=5)
        self.url = f"{auth.server}/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{name}"

    def get(self) -> dict[str, Any] | None:
        resp = self._client.get(self.url)
        if resp.status_code == 404:
            return None
        resp.raise_for_status()
        return dict(resp.json())

    def holder(self) -> str:
        lease = self.get()
        return str(((lease or {}).get("spec") or {}).get("holderIdentity") or "")

    def close(self) -> None:
        self._client.close()


class WorkerProbe:
    """GetStatus of the stages' workers, dialled at their pod IPs (cached until they fail)."""

    def __init__(self, cp: ControlPlane, namespace: str, stages: list[str]) -> None:
        self.cp = cp
        self.namespace = namespace
        self.stages = stages
        self._targets: dict[str, str] = {}
        self._loop = asyncio.new_event_loop()

    def _target(self, stage: str) -> str | None:
        if stage not in self._targets:
            res = self.cp.kubectl(
                "get", "pod", f"{stage}-worker", "-n", self.namespace, "-o", "json", check=False
            )
            if res.returncode != 0:
                return None
            pod = json.loads(res.stdout)
            ip = (pod.get("status") or {}).get("podIP")
            if not ip:
                return None
            port = pod["spec"]["containers"][0].get("ports", [{}])[0].get("containerPort", 50051)
            self._targets[stage] = f"{ip}:{port}"
        return self._targets[stage]

    async def _call(self, target: str) -> Any:
        import grpc

        from omnistage.worker.v1 import sleep_service_pb2, sleep_service_pb2_grpc

        async with grpc.aio.insecure_channel(target) as ch:
            stub = sleep_service_pb2_grpc.SleepServiceStub(ch)
            return await stub.GetStatus(
                sleep_service_pb2.GetStatusRequest(),
                timeout=2,
                metadata=(("authorization", f"Bearer {TOKEN}"),),
            )

    def status(self, stage: str) -> Probe | None:
        target = self._target(stage)
        if target is None:
            return None
        try:
            resp = self._loop.run_until_complete(self._call(target))
        except Exception:
            self._targets.pop(stage, None)
            return None
        return Probe(report_from_proto(resp), int(resp.epoch), time.time())

    def phases(self) -> dict[str, WorkerPhase | None]:
        out: dict[str, WorkerPhase | None] = {}
        for s in self.stages:
            p = self.status(s)
            out[s] = p.report.phase if p else None
        return out

    def close(self) -> None:
        self._loop.close()


class Watcher:
    """Polls the workers in a thread into a ``HoldingLog``; returns once every stage has been
    seen (a stage's first phase is where its holding starts: a hand-over before that first
    sample would make both stages holders from the start)."""

    def __init__(self, probe_args: tuple[ControlPlane, str, list[str]]) -> None:
        self.log = HoldingLog()
        self.stages = probe_args[2]
        self._probe_args = probe_args
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        wait_for(
            "the watcher's first sample of every stage",
            lambda: set(self.stages) <= set(self.log.first_phase),
            30,
        )

    def _run(self) -> None:
        probe = WorkerProbe(*self._probe_args)
        try:
            while not self._stop.is_set():
                for s in self.stages:
                    p = probe.status(s)
                    if p is not None:
                        self.log.record(s, p)
                self._stop.wait(0.02)
        finally:
            probe.close()

    def stop(self) -> HoldingLog:
        self._stop.set()
        self._thread.join(30)
        return self.log
