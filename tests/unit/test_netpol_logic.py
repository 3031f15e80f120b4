"""Pure logic of the real node's NetworkPolicy enforcer and probes (tests/node): no root."""

from __future__ import annotations

from pathlib import Path

from tests.node.gotools import NETPOL, NETPOL_MODULE, NETPOL_VERSION, TOOLS, build_key
from tests.node.netpol import (
    CHAIN,
    QUEUE_ID,
    SA_DIR,
    hook_rules,
    launcher,
    queue_bound,
    rbac,
    unhook_rules,
)
from tests.node.netprobe import GRPC_PORT, HTTP_PORT, outcomes, probe, stand_in

# /proc/net/netfilter/nfnetlink_queue: queue, portid, waiting, copy mode, range, dropped...
QUEUES = "  100  48213     0 2   128     0     0        0  1\n    7   1200     0 2 65531 0 0 0 1\n"


def test_queue_bound_reads_the_listener_table() -> None:
    assert queue_bound(QUEUES, 100)
    assert queue_bound(QUEUES, 7)
    assert not queue_bound(QUEUES, 10)
    assert not queue_bound("", QUEUE_ID)


def test_launcher_gives_the_enforcer_in_cluster_files_in_a_private_mount_namespace() -> None:
    argv = launcher(Path("/c/kube-network-policies"), Path("/s/netpol"), "node-1")
    assert argv[:3] == ["unshare", "--mount", "--"]
    script = argv[-1]
    # the tmpfs /run is mounted before the files are copied, and the binary is exec'd (same
    # pid: SIGINT from the test reaches it and it removes its table)
    assert script.index("mount -t tmpfs") < script.index(f"mkdir -p {SA_DIR}")
    assert "cp /s/netpol/token /s/netpol/ca.crt" in script
    assert "exec /c/kube-network-policies --hostname-override=node-1" in script
    assert f"--nfqueue-id={QUEUE_ID}" in script


def test_hook_queues_new_connections_of_the_pod_subnet_and_unhooks() -> None:
    rules = hook_rules("10.201.3.0/24", 100)
    queued = ["-m", "conntrack", "--ctstate", "NEW", "-j", "NFQUEUE", "--queue-num", "100"]
    assert rules == [
        ["-N", CHAIN],
        ["-A", CHAIN, "-s", "10.201.3.0/24", *queued],
        ["-A", CHAIN, "-d", "10.201.3.0/24", *queued],
        ["-I", "FORWARD", "1", "-j", CHAIN],  # jumped to only once the chain is complete
    ]
    assert unhook_rules() == [["-D", "FORWARD", "-j", CHAIN], ["-F", CHAIN], ["-X", CHAIN]]


def test_rbac_grants_only_list_and_watch() -> None:
    objs = rbac()
    assert [o["kind"] for o in objs] == ["ServiceAccount", "ClusterRole", "ClusterRoleBinding"]
    rules = objs[1]["rules"]
    assert isinstance(rules, list)
    assert {v for r in rules for v in r["verbs"]} == {"list", "watch"}


def test_build_key_names_the_version_and_follows_the_module_files() -> None:
    tool = TOOLS[NETPOL]
    assert build_key(tool).startswith(f"{NETPOL}-{NETPOL_VERSION}_")
    assert f"{NETPOL_MODULE} {NETPOL_VERSION}" in (tool.module_dir / "go.mod").read_text()
    assert f'_ "{NETPOL_MODULE}/cmd"' in (tool.module_dir / "tools.go").read_text()


def test_probe_and_stand_in_pods_fit_restricted_and_report_per_port() -> None:
    pod = probe("n", "p", {"a": "b"}, "10.0.0.2", ports=[HTTP_PORT, GRPC_PORT], window=5)
    spec = pod["spec"]
    assert spec["restartPolicy"] == "Never"
    assert spec["securityContext"]["runAsNonRoot"] is True
    container = spec["containers"][0]
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert container["command"][-4:] == ["10.0.0.2", "5", str(HTTP_PORT), str(GRPC_PORT)]
    server = stand_in("n", "s", {"app.kubernetes.io/name": "omnistage-worker"})
    assert server["spec"]["restartPolicy"] == "Always"
    assert server["spec"]["containers"][0]["command"][-2:] == [str(HTTP_PORT), str(GRPC_PORT)]
    assert outcomes("8000=open 50051=timeout") == {8000: "open", 50051: "timeout"}
    assert outcomes("") == {}
