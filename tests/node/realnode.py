"""A real Kubernetes node beside the local control plane: kubelet + containerd + runc + CNI.

``RealNode(control_plane, kubelet=...)`` is a context manager. On entry it

* makes the node's cgroup root (``/omnistage-<node>`` in every cgroup v1 hierarchy) and a
  state directory holding everything else (containerd's root and state, the kubelet's root
  dir, the CNI config, host-local's allocations, logs);
* starts containerd (Debian's 1.6, CRI v1, runc through ``containerd-shim-runc-v2``, the
  CNI plugins bridge, host-local, loopback and portmap, the locally built pause image as the
  sandbox image) and imports the given OCI archives into its ``k8s.io`` namespace with
  ``ctr images import`` (no registry);
* issues the node a client certificate (``system:node:<name>`` in ``system:nodes``, signed by
  the control plane's CA: the Node authorizer and NodeRestriction apply to it) and starts the
  kubelet built from the same release (cgroupfs, ``failCgroupV1: false``), then waits for the
  Node to be Ready;
* with ``containerd=`` (the directory of containerd 1.7 built by :mod:`tests.node.gotools`),
  runs that containerd and its shim instead of Debian's, with CDI enabled;
* with ``gpus=`` (needs ``containerd=`` and ``dra_plugin=``), gives the node simulated GPUs
  the way a real cluster's GPUs reach containers (:mod:`tests.node.nodegpus`): their
  directories, the host side answering for their processes' host pids
  (:class:`tests.fakegpu.driver.DriverServer`), a CDI spec, the ``gpu.nvidia.com``
  DeviceClass and the DRA kubelet plugin publishing the node's ResourceSlice; a pod claiming a
  GPU gets it through CDI, no hostPath;
* with ``kube_proxy=``, starts kube-proxy of the same release in iptables mode (user
  ``system:kube-proxy``) and waits for the ``kubernetes`` Service's rules: Service ClusterIPs
  then work from the node's pods, the API server's included (it advertises the host's address).
  The iptables chains are the host's and teardown undoes what changed since the start, so one
  real node runs per machine at a time (a lock file; a second waits).

On exit it tears down completely: the node's pods are deleted (the kubelet stops their
sandboxes, CNI DEL), kube-proxy, the kubelet and containerd stop, then whatever is left is
removed (:mod:`tests.node.hostchanges`: shims and container processes of this node, mounts
under the state directory, the netns mounts it created, the bridge, the iptables and ip6tables
rules and chains added meanwhile, the cgroups), then the Node object and the state directory.
``OMNISTAGE_KEEP_NODE=1`` keeps the state directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.cluster.controlplane import ControlPlane
from tests.cluster.hostnet import host_ip
from tests.cluster.kubeconfig import write_cert_kubeconfig
from tests.cluster.lifecycle import Lifecycle
from tests.cluster.localnode.devices import GpuDevice
from tests.cluster.pki import issue_client_cert
from tests.cluster.procs import ManagedProcess, free_port, wait_for
from tests.fakegpu.device import FakeGpu
from tests.fakegpu.driver import DriverServer
from tests.node.gpuconfig import NodeGpus
from tests.node.hostchanges import HostChanges, NodeError, sh
from tests.node.images import PAUSE
from tests.node.nodeconfig import (
    NodeLayout,
    cni_conflist,
    containerd_config,
    dumps,
    kube_proxy_config,
    kubelet_config,
)
from tests.node.nodegpus import make_gpus, start_dra_plugin

READY_TIMEOUT = 180.0
# the host's iptables are shared and teardown undoes what changed meanwhile: one node at a time
NODE_LOCK = Path("/run/omnistage-realnode.lock")


class RealNode(Lifecycle):
    """Context manager running one real node; see the module docstring."""

    def __init__(
        self,
        control_plane: ControlPlane,
        kubelet: Path,
        archives: tuple[Path, ...] = (),
        *,
        name: str | None = None,
        kube_proxy: Path | None = None,
        containerd: Path | None = None,
        gpus: NodeGpus | None = None,
        dra_plugin: Path | None = None,
    ):
        """``kube_proxy``: also run kube-proxy (iptables mode), so Service ClusterIPs work;
        ``containerd``: a directory holding containerd and its runc shim (CDI on);
        ``gpus``: simulated GPUs reached through ``dra_plugin`` and CDI."""
        if gpus is not None and (containerd is None or dra_plugin is None):
            raise ValueError("simulated GPUs need containerd= (CDI) and dra_plugin=")
        self.cp = control_plane
        self.kubelet_bin = kubelet
        self.kube_proxy_bin = kube_proxy
        self.containerd_dir = containerd
        self.gpus = gpus
        self.dra_plugin = dra_plugin
        self.gpu_devices: list[GpuDevice] = []
        self._driver: DriverServer | None = None
        self.archives = archives
        suffix = secrets.token_hex(2)
        self.name = name or f"realnode-{suffix}"
        state = Path(tempfile.mkdtemp(prefix=f"omnistage-{self.name}-"))
        self.layout = NodeLayout(
            state=state,
            name=self.name,
            pause_image=PAUSE.ref,
            subnet=f"10.{200 + int(suffix[:2], 16) % 50}.{int(suffix[2:], 16)}.0/24",
            bridge=f"omni{suffix}",
            cgroup_root=f"/omnistage-{self.name}",
        )
        self.timings: dict[str, float] = {}
        self._procs: list[ManagedProcess] = []
        self.host = HostChanges(self.layout)
        self._lock: int | None = None

    # ---- lifecycle -------------------------------------------------------------------------
    def _started(self, seconds: float) -> str:
        return f"[realnode] {self.name} Ready in {seconds:.1f}s"

    def _start(self) -> None:
        for tool in ("containerd", "containerd-shim-runc-v2", "runc", "ctr"):
            if shutil.which(tool) is None:
                raise NodeError(f"{tool} is missing: apt-get install containerd runc")
        for plugin in ("bridge", "host-local", "loopback", "portmap"):
            if not (Path("/usr/lib/cni") / plugin).is_file():
                raise NodeError(
                    f"CNI plugin {plugin} missing: apt-get install containernetworking-plugins"
                )
        layout = self.layout
        (layout.state / "logs").mkdir(parents=True)
        self._lock = os.open(NODE_LOCK, os.O_CREAT | os.O_RDWR, 0o600)
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        self.host.snapshot()
        self.host.make_cgroups()
        layout.cni_conf_dir.mkdir(parents=True)
        (layout.cni_conf_dir / "10-omnistage.conflist").write_text(dumps(cni_conflist(layout)))
        layout.containerd_config.parent.mkdir(parents=True, exist_ok=True)
        cdi = self.containerd_dir is not None
        layout.containerd_config.write_text(containerd_config(layout, cdi=cdi))
        env = None
        binary = "containerd"
        if self.containerd_dir is not None:  # its shim first on PATH (containerd looks it up)
            env = {**os.environ, "PATH": f"{self.containerd_dir}:{os.environ['PATH']}"}
            binary = str(self.containerd_dir / "containerd")
        if self.gpus is not None:
            self._make_gpus(self.gpus)
        t0 = time.monotonic()
        containerd = self._spawn(
            "containerd", [binary, "--config", str(layout.containerd_config)], env=env
        )
        wait_for(
            "containerd's socket",
            lambda: self.ctr("version") != "",
            60,
            interval=0.2,
            alive=containerd.died,
        )
        self.timings["containerd"] = time.monotonic() - t0
        t0 = time.monotonic()
        for archive in self.archives:
            self.import_archive(archive)
        self.timings["import"] = time.monotonic() - t0
        self._start_kubelet()
        if self.gpus is not None:
            self._start_dra_plugin()
        if self.kube_proxy_bin is not None:
            self._start_kube_proxy(self.kube_proxy_bin)

    def _make_gpus(self, gpus: NodeGpus) -> None:
        self.gpu_devices, self._driver = make_gpus(self.layout, gpus)

    def gpu(self, device: str = "gpu-0") -> FakeGpu:
        """Simulated device ``device`` as the host sees it."""
        return FakeGpu(self.layout.gpu_dir / device)

    def _start_dra_plugin(self) -> None:
        assert self.dra_plugin is not None
        self.timings["dra-plugin"] = start_dra_plugin(
            self.cp, self.layout, self.gpu_devices, self.dra_plugin, self._spawn
        )

    def _start_kubelet(self) -> None:
        layout = self.layout
        pki = self.cp.workdir / "pki"
        cert, key = layout.state / "node.crt", layout.state / "node.key"
        ca = (pki / "ca.crt", pki / "ca.key")
        issue_client_cert(
            *ca, cn=f"system:node:{self.name}", org="system:nodes", cert_out=cert, key_out=key
        )
        write_cert_kubeconfig(
            layout.kubeconfig, self.cp.server, pki / "ca.crt", cert, key, name=self.name
        )
        node_ip = host_ip()  # a node's InternalIP cannot be loopback
        if node_ip is None:
            raise NodeError("this machine has no global IPv4 address for the node")
        config = kubelet_config(layout, pki / "ca.crt", "127.0.0.1")
        config["port"] = free_port()
        config["healthzPort"] = self.healthz_port = free_port()
        layout.kubelet_config.write_text(dumps(config))
        t0 = time.monotonic()
        kubelet = self._spawn(
            "kubelet",
            [
                str(self.kubelet_bin),
                f"--config={layout.kubelet_config}",
                f"--kubeconfig={layout.kubeconfig}",
                f"--root-dir={layout.kubelet_dir}",
                f"--cert-dir={layout.state / 'kubelet-pki'}",
                f"--hostname-override={self.name}",
                f"--node-ip={node_ip}",
                "--v=2",
            ],
        )
        wait_for(
            f"Node {self.name} Ready",
            self.node_ready,
            READY_TIMEOUT,
            interval=0.5,
            alive=kubelet.died,
        )
        self.timings["kubelet"] = time.monotonic() - t0

    def _start_kube_proxy(self, binary: Path) -> None:
        """kube-proxy as ``system:kube-proxy`` (bound to system:node-proxier by the API
        server's default policy); ready once the ``kubernetes`` Service's rules are in."""
        layout = self.layout
        pki = self.cp.workdir / "pki"
        cert, key = layout.state / "kube-proxy.crt", layout.state / "kube-proxy.key"
        issue_client_cert(
            pki / "ca.crt",
            pki / "ca.key",
            cn="system:kube-proxy",
            org=None,
            cert_out=cert,
            key_out=key,
        )
        write_cert_kubeconfig(
            layout.proxy_kubeconfig, self.cp.server, pki / "ca.crt", cert, key, name="kube-proxy"
        )
        config = kube_proxy_config(layout, free_port(), free_port())
        layout.proxy_config.write_text(dumps(config))
        t0 = time.monotonic()
        proxy = self._spawn("kube-proxy", [str(binary), f"--config={layout.proxy_config}", "--v=2"])
        wait_for(
            "kube-proxy's rules for the kubernetes Service",
            lambda: "default/kubernetes:https" in sh("iptables-save", "-t", "nat", check=False),
            READY_TIMEOUT,
            interval=0.5,
            alive=proxy.died,
        )
        self.timings["kube-proxy"] = time.monotonic() - t0

    def _spawn(
        self, name: str, argv: list[str], env: dict[str, str] | None = None
    ) -> ManagedProcess:
        proc = ManagedProcess(name, argv, self.layout.state / "logs" / f"{name}.log", env=env)
        self._procs.append(proc)
        return proc

    # ---- helpers ---------------------------------------------------------------------------
    def ctr(self, *args: str, check: bool = True) -> str:
        """``ctr`` against this node's containerd, namespace ``k8s.io``."""
        return sh("ctr", "--address", str(self.layout.socket), "-n", "k8s.io", *args, check=check)

    def import_archive(self, archive: Path) -> None:
        """Load an OCI archive (``buildah push ... oci-archive:``) into the runtime."""
        if not archive.is_file():
            raise NodeError(f"{archive} is missing: run `make images`")
        # unpacked now (into the overlayfs snapshotter), not at the first container create
        self.ctr("images", "import", str(archive))

    def images(self) -> list[str]:
        """The image references the runtime holds."""
        return self.ctr("images", "ls", "-q").split()

    def node(self) -> dict[str, Any]:
        """The Node object."""
        return self.cp.get_json("node", self.name)

    def node_ready(self) -> bool:
        """Whether the Node reports Ready=True."""
        conditions = self.node().get("status", {}).get("conditions", [])
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    def log(self, component: str) -> Path:
        """The log file of ``kubelet`` or ``containerd``."""
        return self.layout.state / "logs" / f"{component}.log"

    def container_logs(self, namespace: str, pod: str, tail: int = 40) -> str:
        """The last lines of a pod's container logs, read on the node (the API server has no
        kubelet client certificate for kubectl logs)."""
        found = []
        for path in sorted((self.layout.state / "pods-logs").glob(f"{namespace}_{pod}_*/*/*.log")):
            lines = path.read_text(errors="replace").splitlines()[-tail:]
            found.append(f"== {path.parent.name}/{path.name}\n" + "\n".join(lines))
        return "\n".join(found)

    # ---- teardown --------------------------------------------------------------------------
    def stop(self) -> None:
        """Tear everything down (idempotent); see the module docstring."""
        start = time.monotonic()
        kubelet_alive = any(p.name == "kubelet" and p.died() is None for p in self._procs)
        if kubelet_alive:
            self._drain()
        proxy_ran = any(p.name == "kube-proxy" for p in self._procs)
        for proc in reversed(self._procs):
            proc.stop(grace=10.0)
        self._procs.clear()
        if proxy_ran and self.kube_proxy_bin is not None:  # its own removal of its rules
            sh(str(self.kube_proxy_bin), "--cleanup", check=False)
        self.host.kill_processes()
        if self._driver is not None:
            self._driver.__exit__(None, None, None)
            self._driver = None
        self.host.undo()
        with contextlib.suppress(Exception):
            self.cp.kubectl("delete", "node", self.name, "--ignore-not-found", "--wait=false")
        if not os.environ.get("OMNISTAGE_KEEP_NODE"):
            shutil.rmtree(self.layout.state, ignore_errors=True)
        if self._lock is not None:
            os.close(self._lock)  # releases the lock
            self._lock = None
        self.timings["teardown"] = time.monotonic() - start
        print(f"[realnode] {self.name} torn down in {self.timings['teardown']:.1f}s", flush=True)

    def _drain(self, timeout: float = 60.0) -> None:
        """Delete the node's pods and wait until the kubelet has removed them."""
        selector = f"spec.nodeName={self.name}"

        def pods() -> list[dict[str, Any]]:
            items: list[dict[str, Any]] = self.cp.get_json(
                "pods", "-A", "--field-selector", selector
            )["items"]
            return items

        with contextlib.suppress(Exception):
            for pod in pods():
                meta = pod["metadata"]
                self.cp.kubectl(
                    "delete", "pod", meta["name"], "-n", meta["namespace"], "--wait=false"
                )
        with contextlib.suppress(Exception):
            wait_for(f"the pods of {self.name} gone", lambda: not pods(), timeout, interval=0.5)
        # the sandboxes stopped too (their CNI DEL runs as the kubelet stops them)
        with contextlib.suppress(Exception):
            wait_for(
                "no task left running",
                lambda: self.ctr("tasks", "ls", "-q").strip() == "",
                30,
                interval=0.5,
            )

    def leftovers(self) -> list[str]:
        """What of this node is still on the machine (empty after a clean teardown)."""
        return self.host.leftovers()


def main() -> int:
    """``python -m tests.node.realnode``: start a node, print how to use it, wait for ^C."""
    from tests.cluster.build import ensure_kubelet
    from tests.node.images import IMAGES, archive_path

    archives = tuple(archive_path(s) for s in (PAUSE, *IMAGES.values()))
    kubelet = ensure_kubelet()
    proxy = kubelet.parent / "kube-proxy"
    with ControlPlane() as cp, RealNode(cp, kubelet, archives, kube_proxy=proxy) as node:
        print(f"export KUBECONFIG={cp.kubeconfig}   # node {node.name}", flush=True)
        print(json.dumps(node.timings), flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            signal.sigwait({signal.SIGINT, signal.SIGTERM})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
