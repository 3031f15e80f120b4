"""The real node's NetworkPolicy enforcer: kube-network-policies as a host process.

The bridge CNI of :class:`tests.node.realnode.RealNode` ignores NetworkPolicy. ``Enforcer(cp,
node, binary, subnet, state)`` is a context manager that runs SIG Network's kube-network-policies
(built by :mod:`tests.node.gotools`) on the host, as its DaemonSet would in the host's network
namespace: on entry it

* creates its ServiceAccount, ClusterRole (list/watch pods, namespaces, networkpolicies) and
  binding, and issues the account a token;
* starts the binary in a private mount namespace whose ``/run`` is a fresh tmpfs holding that
  token and the cluster CA at the in-cluster paths (its only way to configure a client), with
  ``KUBERNETES_SERVICE_HOST``/``PORT`` naming the API server, and waits until it listens on its
  NFQUEUE;
* hooks the node's pod traffic to that queue with iptables: the first packet of each new
  connection forwarded to or from the node's pod subnet (pod to pod crosses FORWARD through
  the bridge's netfilter hooks) is queued, and kube-network-policies accepts or drops it by the
  NetworkPolicies (a refused client times out).

The hook stands in for the enforcer's own nftables rules, which this machine's kernel cannot
load (built without ``CONFIG_NFT_QUEUE``: its batch fails with ENOENT and it logs "syncing
nftables rules" errors); the kernel has the iptables NFQUEUE target. Its verdicts are its own.
On exit the hook goes, the enforcer stops with SIGINT (and removes whatever table it made), the
RBAC objects are deleted. ``leftovers()`` lists what remains.
"""

from __future__ import annotations

import contextlib
import shlex
import signal
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

from tests.cluster.controlplane import ControlPlane
from tests.cluster.lifecycle import Lifecycle
from tests.cluster.procs import ManagedProcess, wait_for

TABLE = "kube-network-policies"
QUEUE_ID = 100
ACCOUNT = "kube-network-policies"
SA_DIR = "/run/secrets/kubernetes.io/serviceaccount"
QUEUES = Path("/proc/net/netfilter/nfnetlink_queue")
CHAIN = "OMNISTAGE-NETPOL"
READY_TIMEOUT = 120.0


def rbac(namespace: str = "kube-system") -> list[dict[str, object]]:
    """The enforcer's ServiceAccount, ClusterRole and ClusterRoleBinding."""
    return [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": ACCOUNT, "namespace": namespace},
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": ACCOUNT},
            "rules": [
                {
                    "apiGroups": [""],
                    "resources": ["pods", "namespaces"],
                    "verbs": ["list", "watch"],
                },
                {
                    "apiGroups": ["networking.k8s.io"],
                    "resources": ["networkpolicies"],
                    "verbs": ["list", "watch"],
                },
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": ACCOUNT},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": ACCOUNT,
            },
            "subjects": [{"kind": "ServiceAccount", "name": ACCOUNT, "namespace": namespace}],
        },
    ]


def launcher(binary: Path, secrets: Path, node: str) -> list[str]:
    """argv: a private mount namespace with the in-cluster files under a tmpfs ``/run``."""
    script = " && ".join(
        [
            "mount --make-rprivate /",
            "mount -t tmpfs -o mode=0755 tmpfs /run",
            f"mkdir -p {SA_DIR}",
            f"cp {shlex.quote(str(secrets))}/token {shlex.quote(str(secrets))}/ca.crt {SA_DIR}/",
            shlex.join(
                [
                    "exec",
                    str(binary),
                    f"--hostname-override={node}",
                    f"--nfqueue-id={QUEUE_ID}",
                    "--metrics-bind-address=127.0.0.1:0",
                    # the conntrack race it works around is fixed in the kernels it names (6.12+)
                    "--netfilter-bug-1766-fix=false",
                    "--v=2",
                ]
            ),
        ]
    )
    return ["unshare", "--mount", "--", "sh", "-c", script]


def queue_bound(proc_text: str, queue: int = QUEUE_ID) -> bool:
    """Whether ``/proc/net/netfilter/nfnetlink_queue`` shows a listener on ``queue``."""
    return any(line.split()[:1] == [str(queue)] for line in proc_text.splitlines())


def hook_rules(subnet: str, queue: int = QUEUE_ID) -> list[list[str]]:
    """iptables argument lists queueing new connections forwarded to or from ``subnet``."""
    queued = ["-m", "conntrack", "--ctstate", "NEW", "-j", "NFQUEUE", "--queue-num", str(queue)]
    return [
        ["-N", CHAIN],
        ["-A", CHAIN, "-s", subnet, *queued],
        ["-A", CHAIN, "-d", subnet, *queued],
        ["-I", "FORWARD", "1", "-j", CHAIN],
    ]


def unhook_rules() -> list[list[str]]:
    """iptables argument lists removing what :func:`hook_rules` added."""
    return [["-D", "FORWARD", "-j", CHAIN], ["-F", CHAIN], ["-X", CHAIN]]


def _iptables(args: list[str], check: bool) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["iptables", "-w", *args], capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise RuntimeError(f"iptables {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc


def table_exists() -> bool:
    """Whether the enforcer's nftables table is loaded."""
    return (
        subprocess.run(
            ["nft", "list", "table", "inet", TABLE], capture_output=True, check=False
        ).returncode
        == 0
    )


class Enforcer(Lifecycle):
    """kube-network-policies for one real node; see the module docstring."""

    def __init__(
        self, control_plane: ControlPlane, node: str, binary: Path, *, subnet: str, state: Path
    ):
        """``subnet``: the node's pod subnet; ``state``: a directory of the node's (the token,
        the CA copy, the log)."""
        self.cp = control_plane
        self.node = node
        self.subnet = subnet
        self._hooked = False
        self.binary = binary
        self.state = state / "netpol"
        self.timings: dict[str, float] = {}
        self._proc: ManagedProcess | None = None

    def _started(self, seconds: float) -> str:
        return f"[netpol] kube-network-policies enforcing on {self.node} in {seconds:.1f}s"

    def _start(self) -> None:
        if not self.binary.is_file():
            raise RuntimeError(f"{self.binary} is missing: run `python -m tests.node.gotools`")
        if queue_bound(QUEUES.read_text()):
            raise RuntimeError(f"NFQUEUE {QUEUE_ID} has a listener already: another enforcer?")
        self.state.mkdir(parents=True)
        self.cp.apply(rbac())
        token = self.cp.kubectl(
            "create", "token", ACCOUNT, "-n", "kube-system", "--duration=2h"
        ).stdout.strip()
        (self.state / "token").write_text(token)
        (self.state / "ca.crt").write_bytes((self.cp.workdir / "pki" / "ca.crt").read_bytes())
        (self.state / "token").chmod(0o600)
        api = urlsplit(self.cp.server)
        env = {
            "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
            "KUBERNETES_SERVICE_HOST": api.hostname or "",
            "KUBERNETES_SERVICE_PORT": str(api.port),
        }
        argv = launcher(self.binary, self.state, self.node)
        self._proc = ManagedProcess(TABLE, argv, self.state / "enforcer.log", env=env)
        wait_for(
            f"kube-network-policies listening on NFQUEUE {QUEUE_ID}",
            lambda: queue_bound(QUEUES.read_text()),
            READY_TIMEOUT,
            interval=0.3,
            alive=self._proc.died,
        )
        self._hooked = True
        for args in hook_rules(self.subnet):
            _iptables(args, check=True)

    def running(self) -> bool:
        """Whether the enforcer is still running."""
        return self._proc is not None and self._proc.died() is None

    def log(self) -> str:
        """The enforcer's log."""
        path = self.state / "enforcer.log"
        return path.read_text(errors="replace") if path.is_file() else ""

    def stop(self) -> None:
        """Unhook, SIGINT (the enforcer removes its table), then the group; the RBAC goes."""
        if self._hooked:
            for args in unhook_rules():
                _iptables(args, check=False)
            self._hooked = False
        if self._proc is not None:
            self._proc.signal_group(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.proc.wait(15)
            self._proc.stop()
            self._proc = None
        if table_exists():
            subprocess.run(["nft", "delete", "table", "inet", TABLE], check=False)
        for obj in rbac():
            meta = obj["metadata"]
            assert isinstance(meta, dict)
            ns = ["-n", meta["namespace"]] if "namespace" in meta else []
            self.cp.kubectl(
                "delete",
                str(obj["kind"]).lower(),
                meta["name"],
                *ns,
                "--ignore-not-found",
                check=False,
            )

    def verdicts(self, last: int = 40) -> str:
        """The enforcer's last per-packet verdict lines (for a failing assertion's message)."""
        lines = [line for line in self.log().splitlines() if "verdict=" in line]
        return "\n".join(lines[-last:])

    def leftovers(self) -> list[str]:
        """What of the enforcer remains on the machine (empty after ``stop``)."""
        found = [f"nftables table inet {TABLE}"] if table_exists() else []
        if queue_bound(QUEUES.read_text()):
            found.append(f"NFQUEUE {QUEUE_ID} listener")
        if _iptables(["-S", CHAIN], check=False).returncode == 0:
            found.append(f"iptables chain {CHAIN}")
        return found
