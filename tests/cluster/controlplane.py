"""A real local Kubernetes control plane: etcd, kube-apiserver, kube-scheduler, controller-manager.

Usage::

    with ControlPlane() as cp:
        cp.kubectl("get", "nodes")
        ns = cp.create_namespace("demo")
        kubeconfig = cp.service_account_kubeconfig(ns, "operator")

``ControlPlane`` starts etcd (data in a temp dir, in-memory-safe ``--unsafe-no-fsync``) and the
API server with envtest-like flags: RBAC and Node authorization, a client-certificate admin in
``system:masters``, service-account token signing (so ``kubectl create token`` works), the
default admission plugins (ServiceAccount, NamespaceLifecycle, TaintNodesByCondition...), and
resource.k8s.io/v1 (DRA) served. Pods on a real node reach it through the ``kubernetes``
Service: it listens on every address and advertises the host's (``advertise_ip``; its serving
certificate names it), so its own endpoint reconciler points the Service there (a machine with
no global IPv4 keeps loopback and no endpoints). The scheduler and the controller-manager
(garbage collector, namespace, service-account, node-lifecycle and DRA resource-claim
controllers, among the defaults) run with the admin kubeconfig. Every process runs in its own
process group and all of them are stopped on exit, even when the body raised. ``timings`` holds
``start`` and ``teardown`` seconds; both are printed.

Attributes and helpers: ``kubeconfig`` (admin kubeconfig path), ``server`` (https URL),
``workdir``, ``binaries``, ``kubectl(*args, input=None, check=True)``,
``helm(*args, input=None, check=True)`` (isolated helm home), ``get_json(*args, namespace=)``,
``apply(manifest, namespace=)`` (dict, list or YAML), ``logs(component)``,
``create_namespace(prefix)``
(waits for its ``default`` ServiceAccount), ``delete_namespace(name, wait=False)``,
``service_account_kubeconfig(namespace, name)``.

Standalone: ``python -m tests.cluster.controlplane [--nodes N] [--gpus G]`` prints
``export KUBECONFIG=...`` and runs until Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.cluster.build import Binaries, ensure_binaries, find_binaries
from tests.cluster.hostnet import host_ip
from tests.cluster.kubeconfig import ssl_context, write_cert_kubeconfig, write_token_kubeconfig
from tests.cluster.lifecycle import Lifecycle
from tests.cluster.pki import Pki, create_pki
from tests.cluster.procs import ManagedProcess, free_port, wait_for

START_TIMEOUT = 90.0


class CommandError(subprocess.CalledProcessError):
    """A kubectl/helm command failed; the message carries its stderr."""

    def __str__(self) -> str:
        return f"{super().__str__()}\nstdout: {self.stdout}\nstderr: {self.stderr}"


class ControlPlane(Lifecycle):
    """Context manager running a local control plane; see the module docstring."""

    def __init__(
        self,
        workdir: Path | None = None,
        binaries: Binaries | None = None,
        build: bool = False,
        controller_manager: bool = True,
        max_inflight: tuple[int, int] | None = None,
        *,
        authorization_config: Path | None = None,
        controllers: str = "*",
        nice: int = 0,
    ):
        """``controller_manager=False``: no kube-controller-manager (the GPU host's bundle may
        leave it out); ``create_namespace`` then creates the ``default`` ServiceAccount itself,
        and nothing garbage-collects, publishes ``kube-root-ca.crt`` or tidies claims.
        ``max_inflight``: the API server's ``--max-requests-inflight`` and
        ``--max-mutating-requests-inflight`` (with API Priority and Fairness, their sum is the
        seats it shares among the priority levels); None: its defaults.
        ``authorization_config``: an ``AuthorizationConfiguration`` file given to the API server
        instead of ``--authorization-mode=Node,RBAC`` (it must list Node and RBAC itself).
        ``controllers``: the controller-manager's ``--controllers``. ``nice``: etcd's and the
        API server's CPU scheduling niceness (negative: ahead of the other processes on the
        machine, as a control plane on its own cores would be; needs root)."""
        self.binaries = binaries or (ensure_binaries() if build else find_binaries())
        self.controller_manager = controller_manager
        self.max_inflight = max_inflight
        self.authorization_config = authorization_config
        self.controllers = controllers
        self.nice = nice
        self._own_workdir = workdir is None
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="omnistage-cp-"))
        self.kubeconfig = self.workdir / "admin.kubeconfig"
        self.etcd_port = free_port()
        self.port = free_port()
        self.server = f"https://127.0.0.1:{self.port}"
        self.advertise_ip = host_ip()
        self.timings: dict[str, float] = {}
        self._procs: list[ManagedProcess] = []
        self._pki: Pki | None = None

    # ---- lifecycle -------------------------------------------------------------------------
    def _started(self, seconds: float) -> str:
        return f"[control-plane] up in {seconds:.1f}s at {self.server}"

    def _start(self) -> None:
        logs = self.workdir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        ips = (self.advertise_ip,) if self.advertise_ip else ()
        pki = self._pki = create_pki(self.workdir / "pki", ips=ips)
        write_cert_kubeconfig(
            self.kubeconfig, self.server, pki.ca_cert, pki.admin_cert, pki.admin_key, name="admin"
        )
        etcd_url = f"http://127.0.0.1:{self.etcd_port}"
        peer = f"http://127.0.0.1:{free_port()}"
        etcd = self._spawn(
            "etcd",
            [
                str(self.binaries.etcd),
                f"--data-dir={self.workdir / 'etcd'}",
                f"--listen-client-urls={etcd_url}",
                f"--advertise-client-urls={etcd_url}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=default={peer}",
                "--unsafe-no-fsync",
                "--log-level=warn",
                "--quota-backend-bytes=4294967296",
            ],
        )
        apiserver = self._spawn("kube-apiserver", self._apiserver_args(pki, etcd_url))
        sched_port, kcm_port = free_port(), free_port()
        kube = str(self.kubeconfig)
        common = [
            f"--kubeconfig={kube}",
            f"--authentication-kubeconfig={kube}",
            f"--authorization-kubeconfig={kube}",
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
        ]
        wait_for("etcd /health", lambda: _http_ok(f"{etcd_url}/health"), 30, alive=etcd.died)
        # the scheduler and controller-manager retry until the API server answers
        scheduler = self._spawn(
            "kube-scheduler",
            [str(self.binaries.scheduler), *common, f"--secure-port={sched_port}"],
        )
        kcm = None
        if self.controller_manager:
            kcm = self._spawn_controller_manager(common, kcm_port, pki)
        wait_for(
            "kube-apiserver /readyz",
            lambda: self._api_ok("/readyz"),
            START_TIMEOUT,
            interval=0.2,
            alive=apiserver.died,
        )
        for name, port, proc in (
            ("kube-scheduler", sched_port, scheduler),
            ("kube-controller-manager", kcm_port, kcm),
        ):
            if proc is None:
                continue
            wait_for(
                f"{name} /healthz",
                functools.partial(_http_ok, f"https://127.0.0.1:{port}/healthz", verify=False),
                START_TIMEOUT,
                interval=0.2,
                alive=proc.died,
            )

    def _spawn_controller_manager(self, common: list[str], port: int, pki: Pki) -> ManagedProcess:
        return self._spawn(
            "kube-controller-manager",
            [
                str(self.binaries.controller_manager),
                *common,
                f"--secure-port={port}",
                f"--service-account-private-key-file={pki.sa_key}",
                f"--root-ca-file={pki.ca_cert}",
                f"--cluster-signing-cert-file={pki.ca_cert}",
                f"--cluster-signing-key-file={pki.ca_key}",
                "--use-service-account-credentials=false",
                f"--controllers={self.controllers}",
                "--concurrent-gc-syncs=5",
            ],
        )

    def _apiserver_args(self, pki: Pki, etcd_url: str) -> list[str]:
        if self.advertise_ip:  # the `kubernetes` Service's endpoint: pods reach it there
            address = ["--bind-address=0.0.0.0", f"--advertise-address={self.advertise_ip}"]
            address.append("--endpoint-reconciler-type=lease")
        else:  # an Endpoints object cannot hold a loopback address
            address = ["--bind-address=127.0.0.1", "--advertise-address=127.0.0.1"]
            address.append("--endpoint-reconciler-type=none")
        limits: list[str] = []
        if self.max_inflight is not None:
            reads, writes = self.max_inflight
            limits = [
                f"--max-requests-inflight={reads}",
                f"--max-mutating-requests-inflight={writes}",
            ]
        return [
            str(self.binaries.apiserver),
            f"--etcd-servers={etcd_url}",
            *address,
            f"--secure-port={self.port}",
            f"--cert-dir={self.workdir / 'apiserver-certs'}",
            f"--tls-cert-file={pki.serving_cert}",
            f"--tls-private-key-file={pki.serving_key}",
            f"--client-ca-file={pki.ca_cert}",
            *(
                [f"--authorization-config={self.authorization_config}"]
                if self.authorization_config is not None
                else ["--authorization-mode=Node,RBAC"]
            ),
            "--enable-admission-plugins=NodeRestriction",
            f"--service-account-key-file={pki.sa_pub}",
            f"--service-account-signing-key-file={pki.sa_key}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            # /16: a Service per stage; a /24 (254 ClusterIPs) refused every Service beyond
            # that with HTTP 500 in the 1000-stage scale runs
            "--service-cluster-ip-range=10.0.0.0/16",
            "--allow-privileged=true",
            "--runtime-config=resource.k8s.io/v1=true",
            "--profiling=false",
            *limits,
            "--v=1",
        ]

    def _spawn(self, name: str, argv: list[str]) -> ManagedProcess:
        if self.nice and name in ("etcd", "kube-apiserver"):
            argv = ["nice", "-n", str(self.nice), *argv]  # every thread inherits it
        proc = ManagedProcess(name, argv, self.workdir / "logs" / f"{name}.log")
        self._procs.append(proc)
        return proc

    def pid(self, name: str) -> int:
        """The process id of the running component ``name`` (e.g. ``kube-apiserver``)."""
        return next(p for p in self._procs if p.name == name).proc.pid

    def stop(self) -> None:
        """Stop every process started (reverse order), then remove the work dir if ours."""
        start = time.monotonic()
        for proc in reversed(self._procs):
            proc.stop(grace=5.0)
        self._procs.clear()
        if self._own_workdir and not os.environ.get("OMNISTAGE_KEEP_CLUSTER"):
            shutil.rmtree(self.workdir, ignore_errors=True)
        self.timings["teardown"] = time.monotonic() - start
        print(f"[control-plane] torn down in {self.timings['teardown']:.1f}s", flush=True)

    # ---- helpers ---------------------------------------------------------------------------
    def _api_ok(self, path: str) -> bool:
        pki = self._pki
        assert pki is not None
        r = httpx.get(
            self.server + path,
            verify=ssl_context(pki.ca_cert, pki.admin_cert, pki.admin_key),
            timeout=2,
        )
        return r.status_code == 200

    def logs(self, component: str) -> Path:
        """The log file of ``component`` (etcd, kube-apiserver, kube-scheduler, ...)."""
        return self.workdir / "logs" / f"{component}.log"

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl with the admin kubeconfig."""
        return self._run(
            [str(self.binaries.kubectl), f"--kubeconfig={self.kubeconfig}", *args],
            input,
            check,
            timeout,
        )

    def helm(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 300
    ) -> subprocess.CompletedProcess[str]:
        """Run helm against this cluster, with its cache/config/data under the work dir."""
        home = self.workdir / "helm"
        env = dict(os.environ)
        env.update(
            KUBECONFIG=str(self.kubeconfig),
            HELM_CACHE_HOME=str(home / "cache"),
            HELM_CONFIG_HOME=str(home / "config"),
            HELM_DATA_HOME=str(home / "data"),
        )
        return self._run([str(self.binaries.helm), *args], input, check, timeout, env)

    @staticmethod
    def _run(
        argv: list[str],
        input: str | None,
        check: bool,
        timeout: float,
        env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            argv, input=input, text=True, capture_output=True, timeout=timeout, env=env, check=False
        )
        if check and proc.returncode != 0:
            raise CommandError(proc.returncode, argv, proc.stdout, proc.stderr)
        return proc

    def get_json(self, *args: str, namespace: str | None = None) -> dict[str, Any]:
        """``kubectl get ARGS -o json`` parsed (add ``namespace`` for namespaced objects)."""
        ns = ["-n", namespace] if namespace else []
        data: dict[str, Any] = json.loads(self.kubectl("get", *args, *ns, "-o", "json").stdout)
        return data

    def wait_crd_established(self, name: str, timeout: float = 60.0) -> None:
        """Poll the CRD ``name`` until its Established condition is True.

        ``kubectl wait --for=condition=Established`` fails at once when it reads the CRD before
        the API server wrote any condition (``.status.conditions accessor error``), which a
        loaded machine hits; this polls instead, failing after ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while True:
            crd = self.get_json("crd", name)
            conditions = (crd.get("status") or {}).get("conditions") or []
            if any(c["type"] == "Established" and c["status"] == "True" for c in conditions):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"CRD {name} not Established after {timeout:.0f}s: {conditions}")
            time.sleep(0.2)

    def apply(
        self, manifest: dict[str, Any] | list[dict[str, Any]] | str, namespace: str | None = None
    ) -> str:
        """``kubectl apply -f -`` of a manifest (dict, list of dicts or YAML text)."""
        if isinstance(manifest, str):
            text = manifest
        else:
            docs = manifest if isinstance(manifest, list) else [manifest]
            text = yaml.safe_dump_all(docs)
        ns = ["-n", namespace] if namespace else []
        return self.kubectl("apply", *ns, "-f", "-", input=text).stdout

    def create_namespace(self, prefix: str = "test") -> str:
        """Create ``<prefix>-<random>`` and wait until its ``default`` ServiceAccount exists."""
        name = f"{prefix}-{secrets.token_hex(3)}"
        self.kubectl("create", "namespace", name)
        if not self.controller_manager:  # its service-account controller would create it
            self.kubectl("create", "serviceaccount", "default", "-n", name)
        wait_for(
            f"ServiceAccount default in namespace {name}",
            lambda: (
                self.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode
                == 0
            ),
            30,
            interval=0.2,
        )
        return name

    def delete_namespace(self, name: str, wait: bool = False) -> None:
        """Delete a namespace (the namespace controller removes its contents)."""
        self.kubectl(
            "delete", "namespace", name, f"--wait={str(wait).lower()}", "--ignore-not-found"
        )

    def service_account_kubeconfig(self, namespace: str, name: str, duration: str = "24h") -> Path:
        """A kubeconfig acting as ServiceAccount ``namespace/name`` (created if missing)."""
        self.kubectl("create", "serviceaccount", name, "-n", namespace, check=False)
        token = self.kubectl(
            "create", "token", name, "-n", namespace, f"--duration={duration}"
        ).stdout.strip()
        assert self._pki is not None
        path = self.workdir / f"sa-{namespace}-{name}.kubeconfig"
        return write_token_kubeconfig(
            path, self.server, self._pki.ca_cert, token, f"{namespace}-{name}", namespace=namespace
        )


def _http_ok(url: str, verify: bool = True) -> bool:
    return httpx.get(url, verify=verify, timeout=2).status_code == 200


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.cluster.controlplane", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--nodes", type=int, default=0, help="localnode GPU nodes to run (default 0)"
    )
    parser.add_argument("--gpus", type=int, default=2, help="fake GPUs per node")
    parser.add_argument("--workdir", type=Path, help="keep state here instead of a temp dir")
    args = parser.parse_args(argv)

    stop = False

    def _term(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _term)
    signal.signal(signal.SIGINT, _term)
    with contextlib.ExitStack() as stack:
        cp = stack.enter_context(ControlPlane(workdir=args.workdir, build=True))
        if args.nodes:
            from tests.cluster.localnode import LocalNodes

            stack.enter_context(LocalNodes(cp.kubeconfig, nodes=args.nodes, gpus=args.gpus))
        print(f"kubeconfig: {cp.kubeconfig}")
        print(f"export KUBECONFIG={cp.kubeconfig}", flush=True)
        while not stop:
            time.sleep(0.5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
