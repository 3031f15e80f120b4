"""The chart's operator Deployment under several value sets: replicas and leader election,
security, mounts, ports and probes, resources, the image, the disruption budget, the Lease's
priority level."""

from __future__ import annotations

from tests.unit.test_chart_support import (
    CHART_DIR,
    FULLNAME,
    NAMESPACE,
    Obj,
    one,
    operator_args,
    operator_container,
    pod_spec,
    render,
    render_error,
    run_helm,
    select,
)

DIGEST = "sha256:" + "ab" * 32


def test_helm_lint_strict_is_clean() -> None:
    proc = run_helm("lint", "--strict", str(CHART_DIR))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 chart(s) failed" in proc.stdout


def test_chart_metadata() -> None:
    import yaml

    chart = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2"
    assert chart["kubeVersion"] == ">=1.34.0-0"
    assert chart["appVersion"] == "0.1.0"


def test_deployment_is_two_replicas_electing_a_leader() -> None:
    deployment = one(render(), "Deployment")
    assert deployment["spec"]["replicas"] == 2
    # The old leader steps down on SIGTERM; the new pod stands by before the old one stops.
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    assert deployment["metadata"]["namespace"] == NAMESPACE
    args = operator_args([deployment])
    assert args[-5:] == [
        "--leader-election",
        f"--lease-name={FULLNAME}",
        "--lease-duration=15",
        "--renew-deadline=10",
        "--retry-period=2",
    ]
    # The Lease lives in the operator's namespace, from the pod's own metadata.
    env = {e["name"]: e for e in operator_container([deployment])["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert env["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}


def test_replicas_prefer_different_nodes() -> None:
    affinity = pod_spec(render())["affinity"]
    (term,) = affinity["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["weight"] == 100
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    labels = one(render(), "Deployment")["spec"]["selector"]["matchLabels"]
    assert term["podAffinityTerm"]["labelSelector"] == {"matchLabels": labels}
    own: Obj = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {}}}
    assert pod_spec(render({"affinity": own}))["affinity"] == own


def test_election_timing_follows_values() -> None:
    values = {"leaderElection": {"leaseDuration": 30, "renewDeadline": 20, "retryPeriod": 4}}
    args = operator_args(render(values))
    assert {"--lease-duration=30", "--renew-deadline=20", "--retry-period=4"} <= set(args)


def test_without_election_one_replica_is_recreated() -> None:
    objs = render({"leaderElection": {"enabled": False}, "replicaCount": 1})
    deployment = one(objs, "Deployment")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    args = operator_args(objs)
    assert "--no-leader-election" in args
    assert not any(a.startswith("--lease") for a in args)


def test_unsafe_replica_and_election_values_are_refused() -> None:
    err = render_error({"leaderElection": {"enabled": False}})  # replicaCount 2 by default
    assert "replicaCount > 1 needs leaderElection.enabled" in err
    err = render_error({"leaderElection": {"leaseDuration": 10, "renewDeadline": 10}})
    assert "renewDeadline must be below leaderElection.leaseDuration" in err
    err = render_error({"leaderElection": {"renewDeadline": 2, "retryPeriod": 2}})
    assert "retryPeriod must be below leaderElection.renewDeadline" in err
    assert "replicaCount" in render_error({"replicaCount": 0})


def test_pod_and_container_security_context() -> None:
    objs = render()
    pod = pod_spec(objs)["securityContext"]
    assert pod["runAsNonRoot"] is True
    assert pod["runAsUser"] == 65532
    assert pod["seccompProfile"] == {"type": "RuntimeDefault"}
    container = operator_container(objs)["securityContext"]
    assert container["runAsNonRoot"] is True
    assert container["runAsUser"] == 65532
    assert container["readOnlyRootFilesystem"] is True
    assert container["allowPrivilegeEscalation"] is False
    assert container["capabilities"] == {"drop": ["ALL"]}
    assert container["seccompProfile"] == {"type": "RuntimeDefault"}


def test_tmp_is_the_only_writable_mount() -> None:
    objs = render()
    mounts = {m["mountPath"]: m for m in operator_container(objs)["volumeMounts"]}
    volumes = {v["name"]: v for v in pod_spec(objs)["volumes"]}
    assert "emptyDir" in volumes[mounts["/tmp"]["name"]]
    writable = [path for path, m in mounts.items() if not m.get("readOnly")]
    assert writable == ["/tmp"]


def test_liveness_probe_and_ports_follow_values() -> None:
    objs = render({"ports": {"metrics": 9090, "liveness": 9091}})
    container = operator_container(objs)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http-metrics": 9090, "http-healthz": 9091}
    probe = container["livenessProbe"]["httpGet"]
    assert probe == {"path": "/healthz", "port": "http-healthz"}
    assert "--metrics-port=9090" in container["args"]
    assert "--liveness-port=9091" in container["args"]


def test_same_metrics_and_liveness_port_is_refused() -> None:
    err = render_error({"ports": {"metrics": 9090, "liveness": 9090}})
    assert "ports.metrics and ports.liveness must differ" in err


def test_resources_come_from_values() -> None:
    resources = {
        "requests": {"cpu": "100m", "memory": "200Mi"},
        "limits": {"cpu": 2, "memory": "1Gi"},
    }
    assert operator_container(render({"resources": resources}))["resources"] == resources


def test_operator_has_startup_readiness_and_liveness_probes() -> None:
    container = operator_container(render())
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "http-healthz"}
    # The startup probe gives a slow start two minutes before liveness can restart it.
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] == 120


def test_image_tag_defaults_to_app_version() -> None:
    container = operator_container(render())
    assert container["image"] == "your-registry.invalid/omnistage-operator:0.1.0"
    assert container["imagePullPolicy"] == "IfNotPresent"


def test_custom_image_digest_pins_the_image() -> None:
    values = {
        "image": {
            "repository": "registry.example/team/operator",
            "tag": "1.2.3",
            "digest": DIGEST,
            "pullPolicy": "Always",
        }
    }
    container = operator_container(render(values))
    assert container["image"] == f"registry.example/team/operator:1.2.3@{DIGEST}"
    assert container["imagePullPolicy"] == "Always"


def test_disruption_budget_keeps_a_standby() -> None:
    objs = render()
    budget = one(objs, "PodDisruptionBudget")
    assert budget["spec"]["maxUnavailable"] == 1
    labels = one(objs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()
    # One replica gets no budget: it would block every node drain.
    single = render({"leaderElection": {"enabled": False}, "replicaCount": 1})
    assert select(single, "PodDisruptionBudget") == []
    assert select(render({"podDisruptionBudget": {"enabled": False}}), "PodDisruptionBudget") == []


def test_lease_requests_get_the_leader_election_priority_level() -> None:
    schema = one(render(), "FlowSchema")
    assert schema["apiVersion"] == "flowcontrol.apiserver.k8s.io/v1"
    assert "namespace" not in schema["metadata"]  # cluster-scoped
    spec = schema["spec"]
    assert spec["priorityLevelConfiguration"] == {"name": "leader-election"}
    # It must match before service-accounts (9000), which sends the rest to workload-low.
    assert spec["matchingPrecedence"] < 9000
    # Least privilege: only the operator's ServiceAccount, only Leases: its own in the release
    # namespace and the namespace claims (every namespace when it serves all).
    (rule,) = spec["rules"]
    assert rule["subjects"] == [
        {"kind": "ServiceAccount", "serviceAccount": {"name": FULLNAME, "namespace": NAMESPACE}}
    ]
    assert "nonResourceRules" not in rule
    assert rule["resourceRules"] == [
        {
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "verbs": ["get", "create", "update", "patch"],
            "namespaces": ["*"],
        }
    ]
    for values, namespaces in (
        ({"watch": {"namespaces": ["team-a", "team-b"]}}, [NAMESPACE, "team-a", "team-b"]),
        ({"watch": {"namespaces": ["team-a", NAMESPACE]}}, [NAMESPACE, "team-a"]),
        ({"rbac": {"scope": "Namespaced"}}, [NAMESPACE]),
    ):
        (served,) = one(render(values), "FlowSchema")["spec"]["rules"]
        assert served["resourceRules"][0]["namespaces"] == namespaces
    named = render({"serviceAccount": {"name": "op-sa"}})
    subject = one(named, "FlowSchema")["spec"]["rules"][0]["subjects"][0]
    assert subject["serviceAccount"]["name"] == "op-sa"
    own = render({"leaderElection": {"flowSchema": {"priorityLevel": "mine"}}})
    assert one(own, "FlowSchema")["spec"]["priorityLevelConfiguration"] == {"name": "mine"}
    off = {"leaderElection": {"flowSchema": {"enabled": False}}}
    assert select(render(off), "FlowSchema") == []
    single = render({"leaderElection": {"enabled": False}, "replicaCount": 1})
    assert select(single, "FlowSchema") == []
    err = render_error({"leaderElection": {"flowSchema": {"matchingPrecedence": 9000}}})
    assert "matchingPrecedence" in err
