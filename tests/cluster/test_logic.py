"""Pure logic of the harness (no cluster): expansion, path rewriting, go.mod, devices, phases."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from tests.cluster.gomod import parse_release_gomod, render_wrapper_gomod, staging_tag
from tests.cluster.kubeconfig import load_kubeconfig, write_token_kubeconfig
from tests.cluster.localnode.__main__ import build_nodes, parse_activation, parse_bytes
from tests.cluster.localnode.container_setup import runtime_env
from tests.cluster.localnode.devices import (
    NodeSpec,
    claim_devices,
    gpu_env,
    node_status,
    parse_visible_devices,
    quantity,
    residual_slack,
    resource_slice,
)
from tests.cluster.localnode.expand import expand, rewrite_path
from tests.cluster.localnode.kubelet import IpPool, deletion_held
from tests.cluster.localnode.podstatus import ContainerStatus, pod_phase, termination_message


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
    uuids = f"{node.device_uuid('gpu-0')},{node.device_uuid('gpu-1')}"
    assert env == {  # every device, in index order; each has its own simulation directory
        "NVIDIA_VISIBLE_DEVICES": uuids,
        "CUDA_VISIBLE_DEVICES": uuids,
        "OMNISTAGE_MEMORY_PROBE": "tests.fakegpu.probe:from_env",
        "OMNISTAGE_FAKE_GPU": f"{tmp_path / 'fakegpu' / 'n0' / 'gpu-0'},"
        f"{tmp_path / 'fakegpu' / 'n0' / 'gpu-1'}",
        # the worker's residual slack scaled to the (smallest) simulated device
        "OMNISTAGE_RESIDUAL_SLACK": str(residual_slack(1024)),
    }
    assert node.device_uuid("gpu-0") != node.device_uuid("gpu-1")
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


def test_simulated_device_physics_and_real_gpu_slice(tmp_path: Path) -> None:
    node = NodeSpec(name="n0", index=0, gpus=1, gpu_memory=80 * 1024**3)
    dev = node.fake_device("gpu-0")
    assert (
        dev.uuid
        == node.device_uuid("gpu-0")
        == resource_slice(node, "u")["spec"]["devices"][0]["attributes"]["uuid"]["string"]
    )
    assert 600 * 1024**2 < dev.context < 620 * 1024**2  # 612 MiB on an H100, scaled
    assert dev.reserve == round(80 * 1024**3 * 0.006) and dev.activation == 0.25
    tuned = NodeSpec(name="n0", index=0, gpu_reserve=0, gpu_context=5, gpu_activation=7)
    assert (tuned.fake_device("gpu-1").reserve, tuned.fake_device("gpu-1").context) == (0, 5)
    assert tuned.fake_device("gpu-1").activation_bytes(10**9) == 7
    assert parse_visible_devices(node.device_uuid("gpu-0"), node) == ["gpu-0"]

    records = [
        {"index": 1, "uuid": "GPU-bbb", "name": "NVIDIA H100 80GB HBM3", "total": 85520809984},
        {"index": 0, "uuid": "GPU-aaa", "name": "NVIDIA H100 80GB HBM3", "total": 85520809984},
    ]
    (real,) = build_nodes(
        1, gpus=9, gpu_memory=1, prefix="h-", first=0, octet=42, real_gpus=records
    )
    assert real.real and real.device_names() == ["gpu-0", "gpu-1"]
    sl = resource_slice(real, "uid")
    first = sl["spec"]["devices"][0]
    assert first["attributes"]["uuid"]["string"] == "GPU-aaa"
    assert first["attributes"]["productName"]["string"] == "NVIDIA H100 80GB HBM3"
    assert first["attributes"]["index"]["int"] == 0
    assert first["capacity"]["memory"]["value"] == "81559Mi"  # NVML's total, as a quantity
    assert node_status(real, "now")["capacity"]["nvidia.com/gpu"] == "2"
    assert gpu_env(real, ["gpu-1", "gpu-0"], tmp_path) == {
        "NVIDIA_VISIBLE_DEVICES": "GPU-aaa,GPU-bbb",
        "CUDA_VISIBLE_DEVICES": "GPU-aaa,GPU-bbb",
    }
    assert parse_visible_devices("GPU-bbb", real) == ["gpu-1"]
    with pytest.raises(ValueError, match="one node"):
        build_nodes(2, gpus=1, gpu_memory=1, prefix="h-", first=0, octet=42, real_gpus=records)


def test_runtime_env_and_termination_message() -> None:
    host = {
        "HOME": "/h",
        "LD_LIBRARY_PATH": "/usr/local/cuda/lib64",
        "CUDA_VISIBLE_DEVICES": "0",
        "NVIDIA_VISIBLE_DEVICES": "all",
        "CUDA_MODULE_LOADING": "LAZY",
        "NVIDIA_DRIVER_CAPABILITIES": "compute,utility",
        "NCCL_NVLS_ENABLE": "0",
        "SECRET_THING": "x",
    }
    assert runtime_env(host, real_gpus=False) == {
        "HOME": "/h",
        "LD_LIBRARY_PATH": "/usr/local/cuda/lib64",
    }
    assert runtime_env(host, real_gpus=True) == {
        "HOME": "/h",
        "LD_LIBRARY_PATH": "/usr/local/cuda/lib64",
        "CUDA_MODULE_LOADING": "LAZY",
        "NVIDIA_DRIVER_CAPABILITIES": "compute,utility",
        "NCCL_NVLS_ENABLE": "0",
    }
    log = b"".join(f"line {i}\n".encode() for i in range(200))
    tail = termination_message("FallbackToLogsOnError", 1, "", log)
    assert tail.splitlines()[0] == "line 120" and len(tail.splitlines()) == 80
    long = b"x" * 5000 + b"\nend\n"
    assert (
        termination_message("FallbackToLogsOnError", 2, "", long)
        == (b"x" * 2043 + b"\nend\n").decode()
    )
    assert termination_message("FallbackToLogsOnError", 0, "", log) == ""  # only on error
    assert termination_message("File", 1, "", log) == ""
    assert termination_message("FallbackToLogsOnError", 1, "bye\n", log) == "bye\n"
    assert len(termination_message("File", 0, "y" * 9000, b"")) == 4096


def test_activation_flag_and_held_deletions() -> None:
    assert parse_activation("25%") == 0.25 and parse_activation("0.5") == 0.5
    assert parse_activation("512Mi") == 512 * 1024**2
    with pytest.raises(argparse.ArgumentTypeError):
        parse_activation("lots")
    faults = {"hold_deletions": ["web", "ns1/api"]}
    assert deletion_held(faults, "any", "web") and deletion_held(faults, "ns1", "api")
    assert not deletion_held(faults, "ns2", "api") and not deletion_held({}, "ns", "web")
