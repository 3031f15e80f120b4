"""Pure logic of the image builds and the real node (tests/node): no root, no processes."""

from __future__ import annotations

import json
from pathlib import Path

from tests.node.images import (
    IMAGES,
    bud_command,
    debian_mirror,
    declared_args,
    parse_size,
)
from tests.node.nodeconfig import (
    NodeLayout,
    cgroup_mounts,
    cni_conflist,
    containerd_config,
    iptables_undo,
    kubelet_config,
    mounts_under,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
LAYOUT = NodeLayout(
    state=Path("/tmp/n"),
    name="n1",
    pause_image="localhost/omnistage-pause:0.1.0",
    subnet="10.230.4.0/24",
    bridge="omni1234",
    cgroup_root="/omnistage-n1",
)


def test_debian_mirror_reads_deb822_and_one_line_sources() -> None:
    deb822 = (
        "Types: deb\nURIs: http://mirror.example/debian-security\nSuites: bookworm-security\n\n"
        "Types: deb\nURIs: http://mirror.example/debian\nSuites: bookworm\n"
    )
    assert debian_mirror(deb822) == "http://mirror.example/debian"
    assert debian_mirror("deb [arch=amd64] http://m.example/debian/ bookworm main\n") == (
        "http://m.example/debian/"
    )
    assert debian_mirror("deb http://m.example/ubuntu noble main\n") is None


def test_parse_size() -> None:
    assert parse_size("1.5 GB") == 1_500_000_000
    assert parse_size("319 MB") == 319_000_000
    assert parse_size("12.3 kB") == 12_300


def test_bud_passes_only_the_base_arguments_a_dockerfile_declares() -> None:
    for name, spec in IMAGES.items():
        declared = declared_args((REPO_ROOT / spec.dockerfile).read_text())
        cmd = bud_command(spec, "localhost/base:1", ["--root", "/r"], declared)
        assert "PYTHON_IMAGE=localhost/base:1" in cmd
        assert ("CUDA_IMAGE=localhost/base:1" in cmd) == (name == "worker")
        assert cmd[-3:] == ["-t", spec.ref, "."]
        assert cmd[:3] == ["buildah", "--root", "/r"]
    assert bud_command(IMAGES["worker"], "b", [], set())[-7:-5] == ["--target", "worker"]


def test_containerd_config_points_everything_into_the_state_dir() -> None:
    text = containerd_config(LAYOUT)
    assert 'sandbox_image = "localhost/omnistage-pause:0.1.0"' in text
    assert 'address = "/tmp/n/containerd/containerd.sock"' in text
    assert 'conf_dir = "/tmp/n/cni/net.d"' in text
    assert "SystemdCgroup = false" in text
    assert 'root = "/tmp/n/containerd/root"' in text


def test_cni_and_kubelet_config() -> None:
    cni = cni_conflist(LAYOUT)
    bridge = cni["plugins"][0]
    assert bridge["type"] == "bridge" and bridge["bridge"] == "omni1234"
    assert bridge["ipMasq"] is False, "no masquerade rule to undo"
    assert bridge["ipam"]["dataDir"] == "/tmp/n/cni/ipam"
    assert bridge["ipam"]["ranges"] == [[{"subnet": "10.230.4.0/24"}]]
    kubelet = kubelet_config(LAYOUT, Path("/ca.crt"), "127.0.0.1")
    assert kubelet["failCgroupV1"] is False
    assert kubelet["cgroupRoot"] == "/omnistage-n1"
    assert kubelet["containerRuntimeEndpoint"] == "unix:///tmp/n/containerd/containerd.sock"
    json.dumps(kubelet)


MOUNTINFO = """\
25 1 254:0 / / rw - ext4 /dev/vda rw
30 25 0:28 / /sys/fs/cgroup rw - tmpfs tmpfs rw
31 30 0:29 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory
32 30 0:30 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw
40 25 0:40 / /tmp/n/kubelet/pods/x/volumes/kubernetes.io~projected/t rw - tmpfs tmpfs rw
41 25 0:41 / /tmp/n/containerd/state/run/abc/rootfs rw - overlay overlay rw
42 25 0:42 / /tmp/nother rw - tmpfs tmpfs rw
"""


def test_cgroup_mounts_and_mounts_under() -> None:
    assert cgroup_mounts(MOUNTINFO) == [
        Path("/sys/fs/cgroup/memory"),
        Path("/sys/fs/cgroup/unified"),
    ]
    under = mounts_under(MOUNTINFO, Path("/tmp/n"))
    assert under == [
        Path("/tmp/n/kubelet/pods/x/volumes/kubernetes.io~projected/t"),
        Path("/tmp/n/containerd/state/run/abc/rootfs"),
    ]


BEFORE = """\
*filter
:INPUT ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
-A INPUT -j OLD
COMMIT
"""
AFTER = """\
*mangle
:KUBE-KUBELET-CANARY - [0:0]
COMMIT
*filter
:INPUT ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:KUBE-FIREWALL - [0:0]
-A INPUT -j OLD
-A INPUT -j KUBE-FIREWALL
-A KUBE-FIREWALL ! -s 127.0.0.0/8 -d 127.0.0.0/8 -m comment --comment "block incoming" -j DROP
COMMIT
"""


def test_iptables_undo_removes_only_what_was_added() -> None:
    assert iptables_undo(BEFORE, AFTER) == [
        ["-t", "mangle", "-F", "KUBE-KUBELET-CANARY"],
        ["-t", "mangle", "-X", "KUBE-KUBELET-CANARY"],
        [
            "-t", "filter", "-D", "KUBE-FIREWALL", "!", "-s", "127.0.0.0/8", "-d",
            "127.0.0.0/8", "-m", "comment", "--comment", "block incoming", "-j", "DROP",
        ],
        ["-t", "filter", "-D", "INPUT", "-j", "KUBE-FIREWALL"],
        ["-t", "filter", "-F", "KUBE-FIREWALL"],
        ["-t", "filter", "-X", "KUBE-FIREWALL"],
    ]  # fmt: skip
    assert iptables_undo(AFTER, AFTER) == []
