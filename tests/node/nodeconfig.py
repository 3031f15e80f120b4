"""Pure logic for the real node: containerd, CNI and kubelet configuration; what to undo.

Nothing here touches the machine. :mod:`tests.node.realnode` writes these files, starts the
processes and, at teardown, undoes what :func:`iptables_undo` and :func:`mounts_under` find.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CNI_BIN_DIR = "/usr/lib/cni"
CNI_PLUGINS = ("bridge", "host-local", "loopback", "portmap")


@dataclass(frozen=True)
class NodeLayout:
    """Where one node keeps everything: all under ``state`` except the cgroups and netns."""

    state: Path
    name: str
    pause_image: str
    subnet: str
    bridge: str
    cgroup_root: str

    @property
    def socket(self) -> Path:
        """containerd's gRPC socket (the CRI endpoint)."""
        return self.state / "containerd" / "containerd.sock"

    @property
    def containerd_config(self) -> Path:
        return self.state / "containerd" / "config.toml"

    @property
    def cdi_dir(self) -> Path:
        """The CDI specs containerd reads (the simulated GPUs')."""
        return self.state / "cdi"

    @property
    def gpu_dir(self) -> Path:
        """The simulated GPUs' directories (one per device) and their staged user-space part."""
        return self.state / "fakegpu"

    @property
    def cni_conf_dir(self) -> Path:
        return self.state / "cni" / "net.d"

    @property
    def ipam_dir(self) -> Path:
        """host-local's allocations (one file per IP, holding the container ID)."""
        return self.state / "cni" / "ipam"

    @property
    def kubelet_dir(self) -> Path:
        return self.state / "kubelet"

    @property
    def kubelet_config(self) -> Path:
        return self.state / "kubelet-config.yaml"

    @property
    def kubeconfig(self) -> Path:
        return self.state / "kubelet.kubeconfig"

    @property
    def proxy_kubeconfig(self) -> Path:
        return self.state / "kube-proxy.kubeconfig"

    @property
    def proxy_config(self) -> Path:
        return self.state / "kube-proxy-config.yaml"


def containerd_config(layout: NodeLayout, cdi: bool = False) -> str:
    """containerd 1.6/1.7 config (version 2): CRI with runc (cgroupfs), CNI, the local pause;
    ``cdi`` (1.7): CDI devices resolved from the node's own spec directory."""
    root = layout.state / "containerd"
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    cdi_lines = ["  enable_cdi = true", f'  cdi_spec_dirs = ["{layout.cdi_dir}"]'] if cdi else []
    return "\n".join(
        [
            "version = 2",
            f'root = "{root / "root"}"',
            f'state = "{root / "state"}"',
            'disabled_plugins = ["io.containerd.snapshotter.v1.aufs", '
            '"io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", '
            '"io.containerd.snapshotter.v1.devmapper"]',
            "[grpc]",
            f'  address = "{layout.socket}"',
            "[ttrpc]",
            f'  address = "{layout.socket}.ttrpc"',
            "[debug]",
            f'  address = "{root / "debug.sock"}"',
            "[metrics]",
            '  address = ""',
            f"[{cri}]",
            f'  sandbox_image = "{layout.pause_image}"',
            "  enable_selinux = false",
            # the kubelet asks for negative OOM scores; this machine lets no one lower its own
            "  restrict_oom_score_adj = true",
            "  disable_apparmor = true",
            *cdi_lines,
            f"[{cri}.containerd]",
            '  snapshotter = "overlayfs"',
            '  default_runtime_name = "runc"',
            "  discard_unpacked_layers = false",
            f"[{cri}.containerd.runtimes.runc]",
            '  runtime_type = "io.containerd.runc.v2"',
            f"[{cri}.containerd.runtimes.runc.options]",
            "  SystemdCgroup = false",
            f"[{cri}.cni]",
            f'  bin_dir = "{CNI_BIN_DIR}"',
            f'  conf_dir = "{layout.cni_conf_dir}"',
            "  max_conf_num = 1",
            "",
        ]
    )


def cni_conflist(layout: NodeLayout) -> dict[str, Any]:
    """bridge + host-local + portmap; no masquerade (pods talk to the host, never beyond)."""
    return {
        "cniVersion": "1.0.0",
        "name": f"omnistage-{layout.name}",
        "plugins": [
            {
                "type": "bridge",
                "bridge": layout.bridge,
                "isGateway": True,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "dataDir": str(layout.ipam_dir),
                    "ranges": [[{"subnet": layout.subnet}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}, "snat": False},
        ],
    }


def kubelet_config(layout: NodeLayout, ca_file: Path, node_ip: str) -> dict[str, Any]:
    """KubeletConfiguration: cgroup v1 opt-in, cgroupfs under the node's own cgroup root."""
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "failCgroupV1": False,
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": layout.cgroup_root,
        "containerRuntimeEndpoint": f"unix://{layout.socket}",
        "address": node_ip,
        "port": 0,  # set by the caller to a free port
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": 0,
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": False},
            "x509": {"clientCAFile": str(ca_file)},
        },
        "authorization": {"mode": "AlwaysAllow"},
        "failSwapOn": False,
        "resolvConf": "/etc/resolv.conf",
        "registerNode": True,
        "serializeImagePulls": False,
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "evictionHard": {
            "memory.available": "100Mi",
            "nodefs.available": "1%",
            "imagefs.available": "1%",
        },
        "syncFrequency": "5s",
        "runtimeRequestTimeout": "10m",
        "fileCheckFrequency": "5s",
        "nodeStatusUpdateFrequency": "5s",
        "localStorageCapacityIsolation": True,
        "enforceNodeAllocatable": ["pods"],
        "maxPods": 20,
        "podPidsLimit": 4096,
        "containerLogMaxSize": "5Mi",
        "podLogsDir": str(layout.state / "pods-logs"),
        "shutdownGracePeriod": "0s",
    }


def kube_proxy_config(layout: NodeLayout, healthz_port: int, metrics_port: int) -> dict[str, Any]:
    """KubeProxyConfiguration: iptables mode for this node's pod subnet; host knobs untouched.

    conntrack sizes and timeouts stay the host's (0: leave as is), NodePorts are not opened on
    localhost (that would set route_localnet), and the OOM score is not lowered (this machine
    refuses it)."""
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "mode": "iptables",
        "clientConnection": {"kubeconfig": str(layout.proxy_kubeconfig)},
        "hostnameOverride": layout.name,
        "clusterCIDR": layout.subnet,
        "detectLocalMode": "ClusterCIDR",
        "healthzBindAddress": f"127.0.0.1:{healthz_port}",
        "metricsBindAddress": f"127.0.0.1:{metrics_port}",
        "oomScoreAdj": 0,
        "conntrack": {
            "maxPerCore": 0,
            "min": 0,
            "tcpEstablishedTimeout": "0s",
            "tcpCloseWaitTimeout": "0s",
        },
        "iptables": {"localhostNodePorts": False, "syncPeriod": "30s", "minSyncPeriod": "0s"},
    }


def cgroup_mounts(mountinfo: str) -> list[Path]:
    """The cgroup hierarchies mounted: v1 ones and, on a hybrid host, the v2 ``unified`` one."""
    found: list[Path] = []
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        fields = left.split()
        if right.split()[:1] in (["cgroup"], ["cgroup2"]) and len(fields) > 4:
            found.append(Path(fields[4]))
    return found


def mounts_under(mountinfo: str, root: Path) -> list[Path]:
    """Mount points at or below ``root``, deepest first (the order to unmount them)."""
    prefix = str(root).rstrip("/") + "/"
    points = []
    for line in mountinfo.splitlines():
        fields = line.split()
        if len(fields) > 4:
            point = fields[4].replace("\\040", " ")
            if point == str(root) or point.startswith(prefix):
                points.append(Path(point))
    return sorted(set(points), key=lambda p: (-len(p.parts), str(p)))


# a user chain (no policy: "-"); a built-in one has a policy and can be neither flushed away
# for good nor deleted
_CHAIN = re.compile(r"^:(\S+)\s+-\s")


def _iptables_tables(save: str) -> dict[str, tuple[list[str], list[str]]]:
    """table -> (user chains, rules) of ``iptables-save`` output."""
    tables: dict[str, tuple[list[str], list[str]]] = {}
    current = ""
    for line in save.splitlines():
        if line.startswith("*"):
            current = line[1:].strip()
            tables[current] = ([], [])
        elif current and (m := _CHAIN.match(line)):
            tables[current][0].append(m.group(1))
        elif current and line.startswith("-A "):
            tables[current][1].append(line[3:])
    return tables


def iptables_undo(before: str, after: str, skip: Collection[str] = ()) -> list[list[str]]:
    """``iptables`` argument lists that remove the rules and chains ``after`` added.

    Rules first (``-D`` by specification, added rules in reverse order), then the new
    chains are flushed and deleted. ``skip``: tables left out (removed whole instead).
    """
    old, new = _iptables_tables(before), _iptables_tables(after)
    commands: list[list[str]] = []
    for table, (chains, rules) in new.items():
        if table in skip:
            continue
        old_chains, old_rules = old.get(table, ([], []))
        for rule in reversed([r for r in rules if r not in old_rules]):
            commands.append(["-t", table, "-D", *_split_rule(rule)])
        for chain in chains:
            if chain not in old_chains:
                commands.append(["-t", table, "-F", chain])
        for chain in chains:
            if chain not in old_chains:
                commands.append(["-t", table, "-X", chain])
    return commands


def iptables_new_tables(before: str, after: str) -> list[str]:
    """Tables ``after`` has that ``before`` had not (iptables-nft makes a table on first use)."""
    old = _iptables_tables(before)
    return [table for table in _iptables_tables(after) if table not in old]


def _split_rule(rule: str) -> list[str]:
    """Split an iptables-save rule into arguments (double-quoted parts kept whole)."""
    return [a.replace('"', "") for a in re.findall(r'"[^"]*"|\S+', rule)]


def dumps(data: dict[str, Any]) -> str:
    """JSON as written to disk."""
    return json.dumps(data, indent=2) + "\n"
