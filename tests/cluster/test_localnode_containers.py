"""localnode: what a container is given and how it is run: env expansion, field, Secret and
ConfigMap references, mounts, devices, restart policy, termination messages, the pod's
ServiceAccount, init containers."""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests.cluster.controlplane import ControlPlane
from tests.cluster.localnode import LocalNodes
from tests.cluster.podwait import condition, envdump, wait_pod

PY = "python"


def test_env_expansion_field_refs_secrets_and_mount_rewriting(
    control_plane: ControlPlane, local_nodes: LocalNodes, namespace: str
) -> None:
    control_plane.kubectl(
        "create", "secret", "generic", "creds", "-n", namespace, "--from-literal=token=s3cret"
    )
    control_plane.kubectl(
        "create", "configmap", "settings", "-n", namespace, "--from-literal=mode=fast"
    )
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "envpod"},
        "spec": {
            "restartPolicy": "Never",
            "volumes": [
                {"name": "creds", "secret": {"secretName": "creds"}},
                {"name": "scratch", "emptyDir": {}},
            ],
            "containers": [
                {
                    "name": "main",
                    "image": "ignored",
                    "command": [PY, "-m", "tests.cluster.testpods.envdump"],
                    "args": ["/etc/creds/token", "--out=/scratch/x", "$(GREETING)", "$$(POD_NAME)"],
                    "env": [
                        {
                            "name": "POD_NAME",
                            "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
                        },
                        {
                            "name": "POD_NS",
                            "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}},
                        },
                        {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                        {
                            "name": "POD_IP",
                            "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
                        },
                        {
                            "name": "SA",
                            "valueFrom": {"fieldRef": {"fieldPath": "spec.serviceAccountName"}},
                        },
                        {"name": "GREETING", "value": "hello-$(POD_NAME)-$(UNDEFINED)"},
                        {
                            "name": "TOKEN",
                            "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}},
                        },
                        {
                            "name": "MODE",
                            "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "mode"}},
                        },
                        {"name": "CREDS_DIR", "value": "/etc/creds"},
                    ],
                    "volumeMounts": [
                        {"name": "creds", "mountPath": "/etc/creds", "readOnly": True},
                        {"name": "scratch", "mountPath": "/scratch"},
                    ],
                }
            ],
        },
    }
    control_plane.apply(pod, namespace=namespace)
    done = wait_pod(
        control_plane,
        namespace,
        "envpod",
        lambda p: p["status"].get("phase") == "Succeeded",
        "Succeeded",
    )
    term = done["status"]["containerStatuses"][0]["state"]["terminated"]
    assert term["exitCode"] == 0 and term["reason"] == "Completed"
    dump = envdump(local_nodes.pod_log(done, "main"))
    env, argv = dump["env"], dump["argv"]
    assert (
        env["POD_NAME"] == "envpod" and env["POD_NS"] == namespace and env["NODE"] == "gpu-node-0"
    )
    assert env["POD_IP"] == done["status"]["podIP"] and env["SA"] == "default"
    assert env["GREETING"] == "hello-envpod-$(UNDEFINED)"
    assert env["TOKEN"] == "s3cret" and env["MODE"] == "fast"
    local_creds = env["CREDS_DIR"]
    assert local_creds != "/etc/creds" and os.path.isdir(local_creds)
    assert argv[0] == f"{local_creds}/token" and dump["files"][argv[0]] == "s3cret"
    assert argv[1].startswith("--out=") and not argv[1].startswith("--out=/scratch/")
    assert argv[2] == "hello-envpod-$(UNDEFINED)" and argv[3] == "$(POD_NAME)"
    assert "NVIDIA_VISIBLE_DEVICES" not in env and "OMNISTAGE_FAKE_GPU" not in env
    assert "OMNISTAGE_MEMORY_PROBE" not in env and "CUDA_VISIBLE_DEVICES" not in env


def test_explicit_device_placement_and_restart_policy(
    control_plane: ControlPlane, local_nodes: LocalNodes, namespace: str
) -> None:
    pod: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "crash"},
        "spec": {
            "restartPolicy": "OnFailure",
            "containers": [
                {
                    "name": "main",
                    "image": "ignored",
                    "command": [PY, "-m", "tests.cluster.testpods.envdump", "--exit=3"],
                    "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "gpu-1"}],
                    "terminationMessagePolicy": "FallbackToLogsOnError",
                }
            ],
        },
    }
    control_plane.apply(pod, namespace=namespace)
    crashed = wait_pod(
        control_plane,
        namespace,
        "crash",
        lambda p: any(
            c.get("restartCount", 0) >= 2 for c in p["status"].get("containerStatuses") or []
        ),
        "restarted twice",
        timeout=60,
    )
    status = crashed["status"]["containerStatuses"][0]
    assert status["lastState"]["terminated"]["exitCode"] == 3
    assert crashed["status"]["phase"] == "Running"
    log = local_nodes.pod_log(crashed, "main")
    # FallbackToLogsOnError: the failed run's log tail (at most 2048 bytes) as its message
    message = status["lastState"]["terminated"]["message"]
    assert message.endswith("}\n") and 0 < len(message.encode()) <= 2048 and message in log
    env = envdump(log)["env"]
    gpu = local_nodes.fake_gpu(0, "gpu-1")
    assert env["NVIDIA_VISIBLE_DEVICES"] == gpu.device().uuid  # the device's UUID, not its name
    assert env["OMNISTAGE_FAKE_GPU"] == str(gpu.dir)
    assert env["OMNISTAGE_MEMORY_PROBE"] == "tests.fakegpu.probe:from_env"
    assert "OMNISTAGE_MEMORY_CAPACITY" not in env and "OMNISTAGE_MEMORY_LEDGER" not in env

    never = {**pod, "metadata": {"name": "once"}, "spec": {**pod["spec"], "restartPolicy": "Never"}}
    control_plane.apply(never, namespace=namespace)
    failed = wait_pod(
        control_plane, namespace, "once", lambda p: p["status"].get("phase") == "Failed", "Failed"
    )
    st = failed["status"]["containerStatuses"][0]
    assert st["restartCount"] == 0 and st["state"]["terminated"]["exitCode"] == 3
    assert st["state"]["terminated"]["reason"] == "Error"
    assert st["state"]["terminated"]["message"].startswith("ENVDUMP ")  # its one-line log


def test_termination_message_file_and_env_a_runtime_gives(
    control_plane: ControlPlane,
    make_local_nodes: Any,
    namespace: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # what localnode's own environment holds on a GPU host: only the runtime's share passes
    monkeypatch.setenv("LD_LIBRARY_PATH", "/opt/fake-cuda/lib64")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setenv("NVIDIA_DRIVER_CAPABILITIES", "compute,utility")
    node: LocalNodes = make_local_nodes(nodes=1, gpus=1)
    script = 'echo "some output"; echo "gave up: $WHY" > "$MSG"; exit 4'
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "quitter"},
        "spec": {
            "restartPolicy": "Never",
            "nodeSelector": {"kubernetes.io/hostname": node.node_names[0]},
            "containers": [
                {
                    "name": "main",
                    "image": "ignored",
                    "command": ["sh", "-c", script],
                    "env": [
                        {"name": "MSG", "value": "/dev/termination-log"},
                        {"name": "WHY", "value": "no model"},
                    ],
                    "terminationMessagePolicy": "FallbackToLogsOnError",
                },
                {
                    "name": "env",
                    "image": "ignored",
                    "command": [PY, "-m", "tests.cluster.testpods.envdump"],
                    "env": [{"name": "CUDA_MODULE_LOADING", "value": "LAZY"}],
                },
            ],
        },
    }
    control_plane.apply(pod, namespace=namespace)
    done = wait_pod(
        control_plane,
        namespace,
        "quitter",
        lambda p: p["status"].get("phase") == "Failed",
        "Failed",
    )
    main = next(c for c in done["status"]["containerStatuses"] if c["name"] == "main")
    # the file the container wrote wins over the log
    assert main["state"]["terminated"]["message"] == "gave up: no model\n"
    assert main["state"]["terminated"]["exitCode"] == 4
    env = envdump(node.pod_log(done, "env"))["env"]
    assert env["LD_LIBRARY_PATH"] == "/opt/fake-cuda/lib64" and env["CUDA_MODULE_LOADING"] == "LAZY"
    # no GPU allocated, simulated GPUs: no host GPU settings reach the pod
    assert "CUDA_VISIBLE_DEVICES" not in env and "NVIDIA_DRIVER_CAPABILITIES" not in env


def test_pod_talks_to_the_api_as_its_service_account(
    control_plane: ControlPlane, local_nodes: LocalNodes, namespace: str
) -> None:
    control_plane.kubectl("create", "serviceaccount", "lister", "-n", namespace)
    control_plane.kubectl(
        "create", "role", "cm-reader", "-n", namespace, "--verb=list", "--resource=configmaps"
    )
    control_plane.kubectl(
        "create", "rolebinding", "cm-reader", "-n", namespace, "--role=cm-reader",
        f"--serviceaccount={namespace}:lister",
    )  # fmt: skip
    kubectl = control_plane.binaries.kubectl
    script = f"{kubectl} get configmaps -o name; {kubectl} get secrets -o name; echo done"
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "client"},
        "spec": {
            "serviceAccountName": "lister",
            "restartPolicy": "Never",
            "containers": [{"name": "main", "image": "ignored", "command": ["sh", "-c", script]}],
        },
    }
    control_plane.apply(pod, namespace=namespace)
    done = wait_pod(
        control_plane,
        namespace,
        "client",
        lambda p: p["status"].get("phase") == "Succeeded",
        "done",
    )
    out = local_nodes.pod_log(done, "main")
    assert "configmap/kube-root-ca.crt" in out, out
    assert f'User "system:serviceaccount:{namespace}:lister" cannot list resource "secrets"' in out


def test_init_container_then_missing_secret_is_reported_until_created(
    control_plane: ControlPlane, local_nodes: LocalNodes, namespace: str
) -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "staged"},
        "spec": {
            "restartPolicy": "Never",
            "volumes": [{"name": "work", "emptyDir": {}}],
            "initContainers": [
                {
                    "name": "prepare",
                    "image": "ignored",
                    # only values that START with a mountPath are rewritten: pass paths alone
                    "command": ["sh", "-c", 'echo prepared > "$OUT"'],
                    "env": [{"name": "OUT", "value": "/work/ready.txt"}],
                    "volumeMounts": [{"name": "work", "mountPath": "/work"}],
                }
            ],
            "containers": [
                {
                    "name": "main",
                    "image": "ignored",
                    "command": [PY, "-m", "tests.cluster.testpods.envdump", "/work/ready.txt"],
                    "env": [
                        {
                            "name": "TOKEN",
                            "valueFrom": {"secretKeyRef": {"name": "late", "key": "t"}},
                        }
                    ],
                    "volumeMounts": [{"name": "work", "mountPath": "/work"}],
                }
            ],
        },
    }
    control_plane.apply(pod, namespace=namespace)

    def config_error(p: dict[str, Any]) -> bool:
        statuses = p["status"].get("containerStatuses") or []
        waiting = statuses[0]["state"].get("waiting", {}) if statuses else {}
        return waiting.get("reason") == "CreateContainerConfigError"

    waiting = wait_pod(
        control_plane, namespace, "staged", config_error, "CreateContainerConfigError"
    )
    message = waiting["status"]["containerStatuses"][0]["state"]["waiting"]["message"]
    assert "late" in message, message
    init = waiting["status"]["initContainerStatuses"][0]
    assert init["state"]["terminated"]["exitCode"] == 0
    assert (condition(waiting, "Initialized") or {}).get("status") == "True"
    control_plane.kubectl(
        "create", "secret", "generic", "late", "-n", namespace, "--from-literal=t=ok"
    )
    done = wait_pod(
        control_plane,
        namespace,
        "staged",
        lambda p: p["status"].get("phase") == "Succeeded",
        "Succeeded",
        timeout=90,
    )
    dump = envdump(local_nodes.pod_log(done, "main"))
    assert dump["env"]["TOKEN"] == "ok"
    assert list(dump["files"].values()) == ["prepared\n"]
