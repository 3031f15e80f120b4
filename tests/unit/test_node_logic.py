"""Pure logic of the image builds and the real node (tests/node): no root, no processes."""

from __future__ import annotations

import ipaddress
import json
from pathlib import Path

from cryptography import x509

from tests.cluster.hostnet import first_global_ipv4
from tests.cluster.pki import create_pki, issue_client_cert
from tests.node.gpuconfig import NodeGpus, cdi_device_id, cdi_spec, plugin_config
from tests.node.images import (
    FLAVOURS,
    IMAGES,
    archive_path,
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
    iptables_new_tables,
    iptables_undo,
    kube_proxy_config,
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
    # the operator's install never comes from buildah's cache (it ignores the mounted wheels)
    assert "--no-cache" in bud_command(IMAGES["operator"], "b", [], set())
    assert "--layers" in bud_command(IMAGES["worker"], "b", [], set())


def test_the_vllm_flavour_is_the_worker_dockerfiles_vllm_target_under_its_own_tag() -> None:
    vllm, worker = FLAVOURS["vllm"], IMAGES["worker"]
    assert vllm.ref == "localhost/omnistage-worker:0.1.0-vllm" != worker.ref
    assert archive_path(vllm).name == "omnistage-worker-0.1.0-vllm.oci.tar"
    assert archive_path(vllm) != archive_path(worker) and vllm.key != worker.key
    declared = declared_args((REPO_ROOT / vllm.dockerfile).read_text())
    assert bud_command(vllm, "b", [], declared)[-7:-5] == ["--target", "vllm"]
    # `make images` (and the node tests' imports) leave it out
    assert "vllm" not in IMAGES and vllm not in IMAGES.values()


def test_containerd_config_points_everything_into_the_state_dir() -> None:
    text = containerd_config(LAYOUT)
    assert 'sandbox_image = "localhost/omnistage-pause:0.1.0"' in text
    assert 'address = "/tmp/n/containerd/containerd.sock"' in text
    assert 'conf_dir = "/tmp/n/cni/net.d"' in text
    assert "SystemdCgroup = false" in text
    assert 'root = "/tmp/n/containerd/root"' in text


def test_containerd_config_enables_cdi_from_the_node_s_own_spec_dir() -> None:
    assert "enable_cdi" not in containerd_config(LAYOUT)  # Debian's 1.6 has no CDI
    text = containerd_config(LAYOUT, cdi=True)
    assert "enable_cdi = true" in text
    assert 'cdi_spec_dirs = ["/tmp/n/cdi"]' in text


def test_cdi_spec_mounts_each_device_and_the_fake_driver_library() -> None:
    devices = NodeGpus(count=2, memory=1_100_000).spec("n1").devices()
    dirs = {d.name: Path(f"/tmp/n/fakegpu/{d.name}") for d in devices}
    spec = cdi_spec(devices, dirs, Path("/tmp/n/fakegpu/lib"))
    assert spec["kind"] == "omnistage.io/fakegpu"
    assert [d["name"] for d in spec["devices"]] == ["gpu-0", "gpu-1"]
    edits = spec["devices"][1]["containerEdits"]
    env = dict(e.split("=", 1) for e in edits["env"])
    assert env["OMNISTAGE_FAKE_GPU"] == "/run/omnistage-fakegpu/gpu-1"
    assert env["OMNISTAGE_MEMORY_PROBE"] == "tests.fakegpu.probe:from_env"
    assert env["CUDA_VISIBLE_DEVICES"] == env["NVIDIA_VISIBLE_DEVICES"] == devices[1].uuid
    assert edits["mounts"][0]["hostPath"] == "/tmp/n/fakegpu/gpu-1"
    assert "rw" in edits["mounts"][0]["options"]
    common = spec["containerEdits"]
    assert common["env"] == ["PYTHONPATH=/opt/omnistage-fakegpu"]
    assert common["mounts"][0]["containerPath"] == "/opt/omnistage-fakegpu"
    assert "ro" in common["mounts"][0]["options"]
    # the plugin names exactly these devices
    config = plugin_config("n1", devices)
    assert config["cdiKind"] == spec["kind"] and config["driver"] == "gpu.nvidia.com"
    assert [d["uuid"] for d in config["devices"]] == [d.uuid for d in devices]
    assert cdi_device_id("gpu-1") == "omnistage.io/fakegpu=gpu-1"


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
    assert iptables_undo(BEFORE, AFTER, skip={"mangle"}) == iptables_undo(BEFORE, AFTER)[2:]


def test_iptables_undo_on_a_host_without_tables() -> None:
    """A fresh host has no table at all: everything after is the node's, built-in chains stay."""
    assert iptables_new_tables("", AFTER) == ["mangle", "filter"]
    assert iptables_new_tables(BEFORE, AFTER) == ["mangle"]
    undo = iptables_undo("", AFTER)
    assert ["-t", "filter", "-D", "INPUT", "-j", "OLD"] in undo
    assert ["-t", "filter", "-X", "KUBE-FIREWALL"] in undo
    assert not [c for c in undo if c[3] in ("INPUT", "OUTPUT") and c[2] in ("-F", "-X")]


def test_first_global_ipv4() -> None:
    out = (
        "4: eth0    inet 192.0.2.2/24 brd 192.0.2.255 scope global eth0\\       valid_lft forever\n"
        "5: eth1    inet 198.51.100.7/24 scope global eth1\n"
    )
    assert first_global_ipv4(out) == "192.0.2.2"
    assert first_global_ipv4("") is None


def test_kube_proxy_config_leaves_the_hosts_knobs_alone() -> None:
    config = kube_proxy_config(LAYOUT, 4001, 4002)
    assert config["mode"] == "iptables"
    assert config["hostnameOverride"] == "n1"
    assert config["clusterCIDR"] == "10.230.4.0/24"
    assert config["clientConnection"]["kubeconfig"] == "/tmp/n/kube-proxy.kubeconfig"
    assert config["healthzBindAddress"] == "127.0.0.1:4001"
    assert config["metricsBindAddress"] == "127.0.0.1:4002"
    assert config["conntrack"]["maxPerCore"] == 0 and config["conntrack"]["min"] == 0
    assert config["iptables"]["localhostNodePorts"] is False
    assert config["oomScoreAdj"] == 0


def test_serving_cert_names_the_advertised_address_and_clients_get_their_groups(
    tmp_path: Path,
) -> None:
    pki = create_pki(tmp_path / "pki", ips=("192.0.2.2",))
    serving = x509.load_pem_x509_certificate(pki.serving_cert.read_bytes())
    sans = serving.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    ips = {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)}
    assert ips == {"127.0.0.1", "10.0.0.1", "192.0.2.2"}
    assert ipaddress.ip_address("192.0.2.2") in sans.get_values_for_type(x509.IPAddress)
    cert, key = tmp_path / "p.crt", tmp_path / "p.key"
    issue_client_cert(
        pki.ca_cert, pki.ca_key, cn="system:kube-proxy", org=None, cert_out=cert, key_out=key
    )
    client = x509.load_pem_x509_certificate(cert.read_bytes())
    assert client.subject.rfc4514_string() == "CN=system:kube-proxy"
    client.verify_directly_issued_by(x509.load_pem_x509_certificate(pki.ca_cert.read_bytes()))
    issue_client_cert(
        pki.ca_cert, pki.ca_key, cn="system:node:n1", org="system:nodes", cert_out=cert, key_out=key
    )
    node = x509.load_pem_x509_certificate(cert.read_bytes())
    assert node.subject.rfc4514_string() == "O=system:nodes,CN=system:node:n1"
    assert key.stat().st_mode & 0o777 == 0o600
