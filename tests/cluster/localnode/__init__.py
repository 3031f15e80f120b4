"""localnode: plays the kubelet, and a DRA GPU driver's node side, for fake GPU nodes.

``LocalNodes(kubeconfig, nodes=1, gpus=2)`` runs ``python -m tests.cluster.localnode`` as a child
process and waits until its Nodes are Ready, untainted and have published their ResourceSlices.
Leaving the context stops it: every pod process it runs is killed and its Nodes are deleted.

What a node is (see ``devices``): Node ``<prefix><i>`` (default ``gpu-node-0``..) with cpu,
memory, pods and ``nvidia.com/gpu`` capacity, labels ``kubernetes.io/hostname`` and
``localnode.omnistage.io/node=true``; a fresh Lease in ``kube-node-lease``; a ResourceSlice of
driver ``gpu.nvidia.com`` listing ``gpu-0``.. with attributes type/uuid/index/productName and
capacity ``memory``; the DeviceClass ``gpu.nvidia.com``.

What a pod gets (see ``runtime``):
- an IP ``127.<octet>.<node index>.<n>`` (unique while it runs; host IP ``...<node index>.1``;
  ``octet`` is reserved per LocalNodes from 10 up with a lock file, so concurrent test sessions
  on one host never share an address; see ``LocalNodes.node_ip``).
  On one host, ports of 0.0.0.0 are shared, so a pod's server must bind its podIP (pass it
  with ``fieldRef: status.podIP``); probes dial the podIP.
- each container's command+args as a local process with the pod's env (``$(VAR)`` expansion,
  fieldRef/secretKeyRef/configMapKeyRef/resourceFieldRef, envFrom). The executable is looked up
  on PATH with the venv's bin first; ``image`` is ignored. From localnode's own environment
  the process gets only what its image and runtime would give it: PATH, HOME, LANG, LC_ALL,
  TMPDIR, PYTHONPATH, VIRTUAL_ENV, OMNISTAGE_CACHE, LD_LIBRARY_PATH (and, with real GPUs,
  the host's CUDA_*/NVIDIA_* driver settings except device visibility).
- volumes as local dirs: secret/configMap/downwardAPI/projected as files, emptyDir a fresh dir,
  hostPath that path, persistentVolumeClaim ``<state>/pvc/<ns>/<claim>``. Any command, arg,
  env value or workingDir that starts with a volumeMount's mountPath (or whose ``--flag=``
  value does) is rewritten to the local dir, because processes share the host filesystem.
- GPUs: the devices of its allocated ResourceClaims on this node, for containers that list
  the claim in ``resources.claims`` (as with a real DRA driver), else the container's own
  ``NVIDIA_VISIBLE_DEVICES`` (``gpu-0,gpu-1``, ``0,1`` or UUIDs: explicit placement).
  Simulated GPUs (the default): each device is a :mod:`tests.fakegpu` directory
  ``<state>/fakegpu/<node>/<device>`` (``device.json`` written at start: total, driver
  reserve, context per process, activations per request); a container with devices gets
  ``NVIDIA_VISIBLE_DEVICES``/``CUDA_VISIBLE_DEVICES=<their UUIDs>`` (the ResourceSlice's),
  ``OMNISTAGE_MEMORY_PROBE=tests.fakegpu.probe:from_env`` and ``OMNISTAGE_FAKE_GPU=<dirs>``
  (comma-separated, same order), so a ``--device cpu --gpus N`` worker measures each of its
  simulated GPUs, shared with every pod on them. Real GPUs (``real_gpus=True`` /
  ``--real-gpus``): the ResourceSlice lists NVML's devices (uuid, index, productName, memory)
  and a container gets
  ``CUDA_VISIBLE_DEVICES`` and ``NVIDIA_VISIBLE_DEVICES`` = its devices' UUIDs (none:
  ``CUDA_VISIBLE_DEVICES=""``), plus the host's ``CUDA_*``/``NVIDIA_*`` driver settings and
  ``NCCL_*``/``NVSHMEM_*``/``TORCH_SYMM_MEM_*`` switches.
- faults, switched by tests at run time: ``device_faults(node, device, leak_on_sleep=,
  lie=, slow_serving_s=, pid=)`` (see :mod:`tests.fakegpu`), and the kubelet fault
  ``hold_deletions(pod)``: a deleted pod keeps running and stays Terminating (the kubelet
  never confirms) until ``release_deletions(pod)``.
- API access as its ServiceAccount: when the pod has the usual projected token volume
  (kube-api-access-*), its containers get ``KUBECONFIG`` naming a kubeconfig with that token
  (unless they set KUBECONFIG), since a local process cannot see the token at the in-cluster
  path; Kubernetes clients fall back to KUBECONFIG, so an operator pod runs with its RBAC.
- Services get no endpoints: EndpointSlices refuse loopback addresses, so clients must dial
  podIPs (the controller-manager logs FailedToUpdateEndpointSlices for such Services).
- status: podIP(s), hostIP(s), phase, conditions, container states with exit codes and restart
  counts; Ready from the readinessProbe (grpc, tcpSocket, httpGet, exec; periodSeconds,
  thresholds); liveness and startup probes kill and restart; restartPolicy with back-off
  (1 s doubling to 30 s; the kubelet uses 10 s to 5 min), ``lastState`` on restart. Output
  goes to a log file named in the annotation ``localnode.omnistage.io/log-<container>``.
  ``terminationMessagePath`` (default /dev/termination-log) is a fresh local file per run (the
  path is rewritten in command/args/env like a mount); its content becomes
  ``state.terminated.message``, and with ``terminationMessagePolicy: FallbackToLogsOnError``
  a failed container with an empty file gets its log's tail (80 lines / 2048 bytes).
- Events like the kubelet's (Started, Killing, Unhealthy, BackOff, Failed, FailedMount), so
  ``kubectl describe pod`` tells what happened.
- deletion: SIGTERM to the process group, the grace period, SIGKILL, then the pod object is
  deleted with grace 0, so it disappears only after its processes are gone.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import httpx

from tests.cluster.kubeconfig import auth_context, load_kubeconfig
from tests.cluster.localnode.devices import GiB, fake_gpu_dir, node_address, octets_needed
from tests.cluster.localnode.kubelet import KUBELET_FAULTS
from tests.cluster.localnode.simlaunch import HOSTS_FILE
from tests.cluster.localnode.stats import STATS_FILE
from tests.cluster.procs import ManagedProcess, wait_for
from tests.fakegpu.device import FakeGpu, Snapshot

__all__ = ["LocalNodes"]

REPO_ROOT = Path(__file__).resolve().parents[3]


def octets_with_sockets(tcp_tables: Sequence[str]) -> set[int]:
    """Second octets of the 127.x.y.z addresses TCP sockets are bound to, from the text of
    ``/proc/net/tcp`` (the address in hex, in the host's byte order: little-endian here)."""
    octets: set[int] = set()
    for table in tcp_tables:
        for line in table.splitlines()[1:]:
            fields = line.split()
            if len(fields) < 2 or ":" not in fields[1]:
                continue
            address = fields[1].split(":", 1)[0]
            if len(address) == 8 and address.upper().endswith("7F"):
                octets.add(int(address[4:6], 16))
    return octets


def _bound_octets() -> set[int]:
    try:
        return octets_with_sockets([Path("/proc/net/tcp").read_text()])
    except OSError:
        return set()


def reserve_ip_octet(first: int = 10, count: int = 1) -> tuple[int, list[IO[bytes]]]:
    """Reserve ``count`` consecutive second octets for pod IPs, unique among localnodes here.

    Several test sessions may run at once on one machine; each LocalNodes holds an exclusive
    lock on ``<tmp>/omnistage-localnode-ip/<octet>.lock`` while it runs (released by the OS if
    the process dies), so no two hand out the same 127.x.y.z. (250 nodes per octet.) An octet
    with a TCP socket still bound to one of its addresses is passed over even when its lock is
    free: a pod's process that outlived its localnode keeps its port, and the next pod given
    that IP could not bind it.
    """
    lock_dir = Path(tempfile.gettempdir()) / "omnistage-localnode-ip"
    lock_dir.mkdir(exist_ok=True)
    bound = _bound_octets()
    for octet in range(first, 256 - count):
        if bound & set(range(octet, octet + count)):
            continue
        held: list[IO[bytes]] = []
        for o in range(octet, octet + count):
            fh = (lock_dir / f"{o}.lock").open("wb")
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                fh.close()
                break
            held.append(fh)
        if len(held) == count:
            return octet, held
        for lock in held:
            lock.close()
    raise RuntimeError(f"no {count} free pod IP block(s) left in {lock_dir}")


def pod_processes(octets: Sequence[int], proc: Path = Path("/proc")) -> list[int]:
    """Pids of the processes whose command line names an address of these pod IP blocks
    (``127.<octet>.``): the pods' servers are given their podIP to bind (``--host``)."""
    prefixes = tuple(f"127.{o}.".encode() for o in octets)
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if any(p in arg for arg in args for p in prefixes):
            found.append(int(entry.name))
    return found


def end_pod_processes(octets: Sequence[int], timeout: float = 10.0) -> list[int]:
    """Kill what is left of the pods of these IP blocks (a pod process that outlived its
    localnode, or one it was starting as it stopped, would bind a podIP the block's next owner
    hands out) and wait until they are gone; the pids killed."""
    pids = pod_processes(octets)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # gone meanwhile
            os.kill(pid, signal.SIGKILL)
    wait_for(
        f"pod processes of 127.{'/'.join(map(str, octets))}.* gone",
        lambda: not pods_alive(pids),
        timeout,
        interval=0.05,
    )
    return pids


def pods_alive(pids: Sequence[int]) -> list[int]:
    """Those of ``pids`` still running (a zombie counts as gone: it holds no socket)."""
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            alive.append(pid)
    return alive


class LocalNodes:
    """Context manager running localnode for ``nodes`` fake GPU nodes on a cluster."""

    def __init__(
        self,
        kubeconfig: Path,
        *,
        nodes: int = 1,
        gpus: int = 2,
        gpu_memory: int = 80 * GiB,
        name_prefix: str = "gpu-node-",
        ip_octet: int | None = None,
        state_dir: Path | None = None,
        ready_timeout: float = 60.0,
        extra_args: Sequence[str] = (),
        gpu_reserve: int | None = None,
        gpu_context: int | None = None,
        gpu_activation: float | int | None = None,
        real_gpus: bool = False,
        sim_hosts: int = 0,
    ):
        """``gpu_reserve``/``gpu_context`` bytes and ``gpu_activation`` (float: fraction of the
        weights, int: bytes) set the simulated GPUs' physics (None: realistic defaults scaled
        to ``gpu_memory``); ``real_gpus``: one node with the host's GPUs (NVML), no simulation.
        """
        self.kubeconfig = kubeconfig
        self._octet_locks: list[IO[bytes]] = []
        self._octet_count = octets_needed(0, nodes)
        if ip_octet is None:
            ip_octet, self._octet_locks = reserve_ip_octet(count=self._octet_count)
        self.ip_octet = ip_octet
        self.node_names = [f"{name_prefix}{i}" for i in range(nodes)]
        self.gpus = gpus
        self.gpu_memory = gpu_memory
        self._own_state_dir = state_dir is None
        self.state_dir = state_dir or Path(tempfile.mkdtemp(prefix="localnode-"))
        self.log = self.state_dir / "localnode.log"
        self._argv = [
            sys.executable,
            "-m",
            "tests.cluster.localnode",
            f"--kubeconfig={kubeconfig}",
            f"--nodes={nodes}",
            f"--gpus={gpus}",
            f"--gpu-memory={gpu_memory}",
            f"--name-prefix={name_prefix}",
            f"--ip-octet={ip_octet}",
            f"--state-dir={self.state_dir}",
            *([f"--gpu-reserve={gpu_reserve}"] if gpu_reserve is not None else []),
            *([f"--gpu-context={gpu_context}"] if gpu_context is not None else []),
            *(
                [f"--gpu-activation={gpu_activation * 100!r}%"]
                if isinstance(gpu_activation, float)
                else [f"--gpu-activation={gpu_activation}"]
                if gpu_activation is not None
                else []
            ),
            *(["--real-gpus"] if real_gpus else []),
            *([f"--sim-hosts={sim_hosts}"] if sim_hosts else []),
            *extra_args,
        ]
        self._ready_timeout = ready_timeout
        self._auth = load_kubeconfig(kubeconfig)
        self._proc: ManagedProcess | None = None
        self.timings: dict[str, float] = {}

    def __enter__(self) -> LocalNodes:
        start = time.monotonic()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p
        )
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._proc = ManagedProcess("localnode", self._argv, self.log, env=env)
        try:
            wait_for(
                f"localnode nodes {', '.join(self.node_names)} Ready",
                self._nodes_ready,
                self._ready_timeout,
                interval=0.2,
                alive=self._proc.died,
            )
        except BaseException:
            self.stop()
            raise
        self.timings["start"] = time.monotonic() - start
        print(
            f"[localnode] {len(self.node_names)} node(s) ready in {self.timings['start']:.1f}s",
            flush=True,
        )
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop localnode: it kills its pods' processes and deletes its Nodes."""
        if self._proc is not None:
            self._proc.stop(grace=20.0)
            self._proc = None
        if self._octet_locks:  # the block is ours: nothing of its pods outlives it
            octets = list(range(self.ip_octet, self.ip_octet + self._octet_count))
            left = end_pod_processes(octets)
            if left:
                print(f"[localnode] killed {len(left)} pod process(es) left behind", flush=True)
        for fh in self._octet_locks:
            fh.close()
        self._octet_locks = []
        if self._own_state_dir and not os.environ.get("OMNISTAGE_KEEP_CLUSTER"):
            shutil.rmtree(self.state_dir, ignore_errors=True)

    def node_ip(self, index: int = 0) -> str:
        """The host IP of node ``index``; its pods get ``.2..254`` of its /24 (node index
        ``i`` is ``127.<octet + i // 250>.<i % 250>.1``)."""
        return node_address(self.ip_octet, index)

    def sim_hosts(self) -> dict[int, dict[str, Any]]:
        """With ``sim_hosts``: each simulated worker host's ``pid``, ``log`` and ``nodes``."""
        table = json.loads((self.state_dir / HOSTS_FILE).read_text())
        return {int(k): v for k, v in table.items()}

    def stats(self) -> dict[str, Any]:
        """localnode's own latest figures (API requests, CPU; written every few seconds)."""
        try:
            return dict(json.loads((self.state_dir / STATS_FILE).read_text()))
        except (OSError, ValueError):
            return {}

    def pod_log(self, pod: dict[str, Any], container: str) -> str:
        """The output of ``container`` of ``pod`` (from the annotation localnode wrote)."""
        note = (pod["metadata"].get("annotations") or {}).get(
            f"localnode.omnistage.io/log-{container}"
        )
        if not note:
            raise KeyError(f"pod {pod['metadata']['name']} has no log annotation for {container!r}")
        return Path(note).read_text(errors="replace")

    # ---- simulated devices and faults ----------------------------------------------------------

    def fake_gpu(self, node: str | int = 0, device: str = "gpu-0") -> FakeGpu:
        """The simulated GPU ``device`` (name like ``gpu-0``, or its UUID) of ``node``."""
        name = self.node_names[node] if isinstance(node, int) else node
        root = self.state_dir / "fakegpu" / name
        if not device.startswith("gpu-"):
            for candidate in sorted(root.glob("*/device.json")):
                if json.loads(candidate.read_text()).get("uuid") == device:
                    return FakeGpu(candidate.parent)
            raise KeyError(f"node {name} has no simulated GPU with UUID {device!r}")
        directory = fake_gpu_dir(self.state_dir, name, device)
        if not (directory / "device.json").is_file():
            raise KeyError(f"node {name} has no simulated GPU {device!r} (real-GPU mode?)")
        return FakeGpu(directory)

    def device_faults(
        self,
        node: str | int = 0,
        device: str = "gpu-0",
        *,
        pid: int | None = None,
        leak_on_sleep: int | str | None = None,
        lie: bool | None = None,
        slow_serving_s: float | None = None,
        unlisted: bool | None = None,
    ) -> None:
        """Switch faults of a simulated GPU, for process ``pid`` (None: every process).

        ``leak_on_sleep``: bytes a sleep leaves behind (``"all"``: everything it freed);
        ``lie``: those bytes stay on the device but the process's own figure omits them;
        ``slow_serving_s``: extra seconds per request; ``unlisted``: the process's own figure
        reads 0 (NVML does not list it). Arguments left None are unchanged;
        read by the workers on their next probe call.
        """
        switches: dict[str, object] = {}
        if leak_on_sleep is not None:
            switches["leak_on_sleep"] = leak_on_sleep
        if lie is not None:
            switches["lie"] = lie
        if slow_serving_s is not None:
            switches["slow_serving_s"] = slow_serving_s
        if unlisted is not None:
            switches["unlisted"] = unlisted
        self.fake_gpu(node, device).set_faults(pid, **switches)

    def clear_device_faults(self, node: str | int = 0, device: str = "gpu-0") -> None:
        """Turn every fault of a simulated GPU off (leaks already made stay)."""
        self.fake_gpu(node, device).clear_faults()

    def device_snapshot(self, node: str | int = 0, device: str = "gpu-0") -> Snapshot:
        """A simulated GPU seen from outside (as nvidia-smi): free and each process's use."""
        return self.fake_gpu(node, device).snapshot()

    def hold_deletions(self, pod: str, namespace: str | None = None) -> None:
        """Kubelet fault: deleting ``pod`` is never confirmed (it runs on, Terminating)."""
        self._edit_held(lambda held: held | {f"{namespace}/{pod}" if namespace else pod})

    def release_deletions(self, pod: str | None = None, namespace: str | None = None) -> None:
        """Let held deletions go through (``pod`` None: all of them)."""
        key = f"{namespace}/{pod}" if namespace else pod
        self._edit_held(lambda held: set() if key is None else held - {key})

    def _edit_held(self, change: Callable[[set[str]], set[str]]) -> None:
        path = self.state_dir / KUBELET_FAULTS
        try:
            faults = json.loads(path.read_text())
        except (OSError, ValueError):
            faults = {}
        faults["hold_deletions"] = sorted(change(set(faults.get("hold_deletions") or [])))
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(faults))
        os.replace(tmp, path)

    def _nodes_ready(self) -> bool:
        """Every node Ready, untainted and with its ResourceSlice (two LISTs, any node count)."""
        auth = self._auth
        headers = {"Authorization": f"Bearer {auth.token}"} if auth.token else {}
        with httpx.Client(
            base_url=auth.server, verify=auth_context(auth), headers=headers, timeout=30
        ) as c:
            r = c.get("/api/v1/nodes", params={"labelSelector": "localnode.omnistage.io/node=true"})
            if r.status_code != 200:
                return False
            ready = {
                node["metadata"]["name"]
                for node in r.json().get("items") or []
                if not node.get("spec", {}).get("taints")
                and any(
                    cond["type"] == "Ready" and cond["status"] == "True"
                    for cond in node.get("status", {}).get("conditions", [])
                )
            }
            if not set(self.node_names) <= ready:
                return False
            slices = c.get("/apis/resource.k8s.io/v1/resourceslices")
            if slices.status_code != 200:
                return False
            published = {s["spec"].get("nodeName") for s in slices.json().get("items") or []}
            return set(self.node_names) <= published
