"""Pure logic of the harness (no cluster): expansion, path rewriting, go.mod, devices, phases."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from tests.cluster.gomod import parse_release_gomod, render_wrapper_gomod, staging_tag
from tests.cluster.kubeconfig import load_kubeconfig, write_token_kubeconfig
from tests.cluster.localnode.__main__ import build_nodes, parse_bytes
from tests.cluster.localnode.devices import (
    NodeSpec,
    claim_devices,
    gpu_env,
    parse_visible_devices,
    quantity,
    resource_slice,
)
from tests.cluster.localnode.expand import expand, rewrite_path
from tests.cluster.localnode.kubelet import IpPool
from tests.cluster.localnode.podstatus import ContainerStatus, pod_phase


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("$(A)-$(B)", "1-$(B)"),
        ("$$(A)", "$(A)"),
        ("$$$(A)", "$1"),
        ("cost $5", "cost $5"),
        ("$(A", "$(A"),
        ("end$", "end$"),
        ("", ""),
    ],
)
def test_expand_follows_kubernetes_rules(text: str, want: str) -> None:
    assert expand(text, {"A": "1"}) == want


def test_rewrite_path_uses_longest_mount_and_flag_values() -> None:
    mounts = {"/models": "/tmp/m", "/models/big": "/tmp/big", "/etc/creds/": "/tmp/c"}
    assert rewrite_path("/models/x/y", mounts) == "/tmp/m/x/y"
    assert rewrite_path("/models/big/w", mounts) == "/tmp/big/w"
    assert rewrite_path("/models", mounts) == "/tmp/m"
    assert rewrite_path("/modelsX", mounts) == "/modelsX"
    assert rewrite_path("--model=/models/x", mounts) == "--model=/tmp/m/x"
    assert rewrite_path("/etc/creds/token", mounts) == "/tmp/c/token"
    assert rewrite_path("plain", mounts) == "plain"


def test_gomod_generation() -> None:
    text = (
        "module k8s.io/kubernetes\n\ngo 1.26.0\n\ngodebug default=go1.26\n\n"
        "replace (\n\tk8s.io/api => ./staging/src/k8s.io/api\n"
        "\tk8s.io/sample-controller => ./staging/src/k8s.io/sample-controller\n)\n"
    )
    rel = parse_release_gomod(text)
    assert rel.go == "1.26.0" and rel.godebug == ("default=go1.26",)
    assert rel.staging == ("k8s.io/api", "k8s.io/sample-controller")
    out = render_wrapper_gomod("w", "v1.36.3", rel, ("k8s.io/api",))
    assert "\tk8s.io/api => k8s.io/api v0.36.3\n" in out
    assert "sample-controller" not in out and "godebug default=go1.26" in out
    assert staging_tag("v1.36.3") == "v0.36.3"
    with pytest.raises(ValueError, match="not a Kubernetes release"):
        staging_tag("1.36")


def test_devices_slices_and_gpu_env(tmp_path: Path) -> None:
    node = NodeSpec(name="n0", index=0, gpus=2, gpu_memory=1024)
    sl = resource_slice(node, "uid-1")
    assert [d["name"] for d in sl["spec"]["devices"]] == ["gpu-0", "gpu-1"]
    assert sl["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert parse_visible_devices("1,gpu-0", node) == ["gpu-1", "gpu-0"]
    assert parse_visible_devices("all", node) == ["gpu-0", "gpu-1"]
    with pytest.raises(ValueError, match="gpu-7"):
        parse_visible_devices("gpu-7", node)
    env = gpu_env(node, ["gpu-1", "gpu-0"], tmp_path)
    assert env["NVIDIA_VISIBLE_DEVICES"] == "gpu-0,gpu-1"
    assert env["OMNISTAGE_MEMORY_CAPACITY"] == "2048"
    assert env["OMNISTAGE_MEMORY_LEDGER"] == str(tmp_path / "ledger" / "n0" / "gpu-0+gpu-1")
    assert gpu_env(node, [], tmp_path) == {}
    assert sl["spec"]["devices"][0]["capacity"]["memory"]["value"] == "1Ki"
    assert [quantity(n) for n in (80 * 1024**3, 3 * 1024**2, 1000, 0)] == [
        "80Gi",
        "3Mi",
        "1000",
        "0",
    ]
    claim = {
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {
                            "request": "gpu",
                            "driver": "gpu.nvidia.com",
                            "pool": "n0",
                            "device": "gpu-1",
                        },
                        {
                            "request": "other",
                            "driver": "gpu.nvidia.com",
                            "pool": "n0",
                            "device": "gpu-0",
                        },
                        {"request": "gpu", "driver": "x.example.com", "pool": "n0", "device": "d"},
                    ]
                }
            }
        }
    }
    assert claim_devices(claim, "n0") == ["gpu-1", "gpu-0"]
    assert claim_devices(claim, "n0", ["gpu"]) == ["gpu-1"]
    assert claim_devices(claim, "n1") == []


def test_ip_pool_round_robin_and_exhaustion() -> None:
    pool = IpPool("127.10.0")
    first = pool.allocate()
    assert first == "127.10.0.2"
    pool.release(first)
    assert pool.allocate() == "127.10.0.3"  # a freed address is not reused at once
    for _ in range(252):
        pool.allocate()
    with pytest.raises(RuntimeError, match="no free pod IP"):
        pool.allocate()


def test_pod_phase() -> None:
    running = ContainerStatus("a", "", state={"running": {}})
    done_ok = ContainerStatus("b", "", state={"terminated": {"exitCode": 0}}, final=True)
    done_bad = ContainerStatus("c", "", state={"terminated": {"exitCode": 2}}, final=True)
    assert pod_phase(False, False, [running]) == "Pending"
    assert pod_phase(True, False, [running, done_ok]) == "Running"
    assert pod_phase(True, False, [done_ok]) == "Succeeded"
    assert pod_phase(True, False, [done_ok, done_bad]) == "Failed"
    assert pod_phase(True, True, [running]) == "Failed"
    assert pod_phase(True, False, [ContainerStatus("d", "")]) == "Pending"


def test_kubeconfig_round_trip(tmp_path: Path) -> None:
    ca = tmp_path / "ca.crt"
    ca.write_text("-----BEGIN CERTIFICATE-----\nabc\n-----END CERTIFICATE-----\n")
    path = write_token_kubeconfig(
        tmp_path / "k", "https://127.0.0.1:6443/", ca, "tok", "sa", namespace="ns1"
    )
    auth = load_kubeconfig(path)
    assert auth.server == "https://127.0.0.1:6443" and auth.token == "tok"
    assert auth.ca_file.read_text() == ca.read_text() and auth.cert_file is None


def test_parse_bytes_and_node_addresses() -> None:
    assert parse_bytes("80Gi") == 80 * 1024**3 and parse_bytes("1000") == 1000
    with pytest.raises(argparse.ArgumentTypeError, match="80GB"):
        parse_bytes("80GB")
    nodes = build_nodes(2, gpus=1, gpu_memory=1, prefix="n-", first=3, octet=42)
    assert [(n.name, n.address) for n in nodes] == [("n-3", "127.42.3.1"), ("n-4", "127.42.4.1")]
