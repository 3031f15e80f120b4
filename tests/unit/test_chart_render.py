"""The chart's rendered objects under several value sets: workload, token, network, metrics."""

from __future__ import annotations

import base64
import re

from tests.unit.test_chart_support import (
    CHART_DIR,
    FULLNAME,
    NAMESPACE,
    RELEASE,
    Obj,
    one,
    operator_container,
    render,
    render_error,
    run_helm,
    select,
)

DIGEST = "sha256:" + "ab" * 32
PEERING_APIS = ("kopf.dev/v1/ClusterKopfPeering", "kopf.dev/v1/KopfPeering")


def _pod_spec(objs: list[Obj]) -> Obj:
    spec: Obj = one(objs, "Deployment")["spec"]["template"]["spec"]
    return spec


def _args(objs: list[Obj]) -> list[str]:
    args: list[str] = operator_container(objs)["args"]
    return args


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
    args = _args([deployment])
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
    affinity = _pod_spec(render())["affinity"]
    (term,) = affinity["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["weight"] == 100
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    labels = one(render(), "Deployment")["spec"]["selector"]["matchLabels"]
    assert term["podAffinityTerm"]["labelSelector"] == {"matchLabels": labels}
    own: Obj = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {}}}
    assert _pod_spec(render({"affinity": own}))["affinity"] == own


def test_election_timing_follows_values() -> None:
    values = {"leaderElection": {"leaseDuration": 30, "renewDeadline": 20, "retryPeriod": 4}}
    args = _args(render(values))
    assert {"--lease-duration=30", "--renew-deadline=20", "--retry-period=4"} <= set(args)


def test_without_election_one_replica_is_recreated() -> None:
    objs = render({"leaderElection": {"enabled": False}, "replicaCount": 1})
    deployment = one(objs, "Deployment")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    args = _args(objs)
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
    pod = _pod_spec(objs)["securityContext"]
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
    volumes = {v["name"]: v for v in _pod_spec(objs)["volumes"]}
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


def test_default_args_follow_the_operator_contract() -> None:
    args = _args(render())
    assert args == [
        "--worker-token-file=/var/run/secrets/omnistage/token",
        "--metrics-port=8080",
        "--liveness-port=8081",
        "--placement=dra",
        "--device-class=gpu.nvidia.com",
        "--sleep-timeout=60",
        "--wake-timeout=600",
        "--ack-retries=3",
        "--round-wait=5",
        "--leader-election",
        f"--lease-name={FULLNAME}",
        "--lease-duration=15",
        "--renew-deadline=10",
        "--retry-period=2",
    ]
    assert not any(a.startswith("--namespace") for a in args), "default serves every namespace"
    assert not any(a.startswith("--peering") for a in args), "default is standalone"


def test_operator_values_become_flags() -> None:
    values = {
        "operator": {
            "placement": "explicit",
            "deviceClass": "gpu.example.com",
            "sleepTimeoutSeconds": 5,
            "wakeTimeoutSeconds": 30,
            "ackRetries": 2,
            "roundWaitSeconds": 1.5,
            "extraArgs": ["--verbose"],
            "extraEnv": [{"name": "TZ", "value": "UTC"}],
        },
        "workerTLS": {"caSecret": "worker-ca", "caKey": "ca.pem"},
    }
    objs = render(values)
    args = _args(objs)
    for flag in (
        "--placement=explicit",
        "--device-class=gpu.example.com",
        "--sleep-timeout=5",
        "--wake-timeout=30",
        "--ack-retries=2",
        "--round-wait=1.5",
        "--verbose",
        "--worker-tls-ca=/var/run/secrets/omnistage-tls/ca.crt",
    ):
        assert flag in args
    assert {"name": "TZ", "value": "UTC"} in operator_container(objs)["env"]
    ca = next(v for v in _pod_spec(objs)["volumes"] if v["name"] == "worker-tls-ca")
    assert ca["secret"]["secretName"] == "worker-ca"
    assert ca["secret"]["items"] == [{"key": "ca.pem", "path": "ca.crt"}]


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


def test_generated_token_secret_is_kept_and_random() -> None:
    first = one(render(), "Secret")
    second = one(render(), "Secret")
    assert first["metadata"]["name"] == f"{FULLNAME}-worker-token"
    assert first["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    token = base64.b64decode(first["data"]["token"]).decode()
    assert re.fullmatch(r"[A-Za-z0-9]{48}", token)
    # Without a cluster to look up, each render generates afresh: the value is random.
    assert first["data"]["token"] != second["data"]["token"]


def test_token_is_mounted_at_the_contract_path() -> None:
    objs = render()
    mount = next(m for m in operator_container(objs)["volumeMounts"] if m["name"] == "worker-token")
    assert mount == {
        "name": "worker-token",
        "mountPath": "/var/run/secrets/omnistage",
        "readOnly": True,
    }
    volume = next(v for v in _pod_spec(objs)["volumes"] if v["name"] == "worker-token")
    assert volume["secret"]["secretName"] == f"{FULLNAME}-worker-token"
    assert volume["secret"]["items"] == [{"key": "token", "path": "token"}]


def test_existing_token_secret_is_used_and_not_generated() -> None:
    objs = render({"workerToken": {"existingSecret": "my-token", "key": "bearer"}})
    assert select(objs, "Secret") == []
    volume = next(v for v in _pod_spec(objs)["volumes"] if v["name"] == "worker-token")
    assert volume["secret"]["secretName"] == "my-token"
    assert volume["secret"]["items"] == [{"key": "bearer", "path": "token"}]


def test_namespaced_watch_becomes_namespace_flags() -> None:
    values = {"rbac": {"scope": "Namespaced"}, "watch": {"namespaces": ["team-a", "team-b"]}}
    args = _args(render(values))
    assert [a for a in args if a.startswith("--namespace")] == [
        "--namespace=team-a",
        "--namespace=team-b",
    ]


def test_namespaced_scope_without_list_serves_the_release_namespace() -> None:
    args = _args(render({"rbac": {"scope": "Namespaced"}}))
    assert [a for a in args if a.startswith("--namespace")] == [f"--namespace={NAMESPACE}"]


def _policy_ingress(policy: Obj) -> Obj:
    """The control-channel rule (gRPC from the operator), always the first."""
    ingress: list[Obj] = policy["spec"]["ingress"]
    return ingress[0]


def _http_rule(policy: Obj) -> Obj:
    """The OpenAI HTTP rule, the second."""
    ingress: list[Obj] = policy["spec"]["ingress"]
    assert len(ingress) == 2, ingress
    return ingress[1]


def test_network_policy_admits_only_the_operator_pods() -> None:
    objs = render()
    policy = one(objs, "NetworkPolicy")
    assert policy["metadata"]["namespace"] == NAMESPACE
    assert policy["spec"]["podSelector"] == {
        "matchLabels": {"app.kubernetes.io/name": "omnistage-worker"}
    }
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    rule = _policy_ingress(policy)
    assert rule["ports"] == [{"protocol": "TCP", "port": 50051}]
    (peer,) = rule["from"]
    assert peer["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": NAMESPACE}}
    # The peer's pod selector must select the operator pod and nothing broader.
    pod_labels = one(objs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    selector = peer["podSelector"]["matchLabels"]
    assert selector.items() <= pod_labels.items()
    assert selector["app.kubernetes.io/instance"] == RELEASE
    assert selector["app.kubernetes.io/component"] == "operator"


def test_network_policy_admits_http_from_the_stage_namespace_by_default() -> None:
    policy = one(render(), "NetworkPolicy")
    rule = _http_rule(policy)
    assert rule["ports"] == [{"protocol": "TCP", "port": 8000}]
    # Every pod of the policy's own namespace (a podSelector without a namespaceSelector).
    assert rule["from"] == [{"podSelector": {}}]


def test_network_policy_admits_the_routers_on_their_worker_ports() -> None:
    values = {
        "networkPolicy": {"namespaces": ["models"], "httpFromSameNamespace": False},
        "router": {
            "enabled": True,
            "groups": [
                {"name": "studio", "stages": ["a"], "namespace": "models", "workerPort": 8001}
            ],
        },
    }
    objs = render(values)
    policy = one(objs, "NetworkPolicy")
    rule = _http_rule(policy)
    assert sorted(p["port"] for p in rule["ports"]) == [8000, 8001]
    (peer,) = rule["from"]
    assert peer["namespaceSelector"]["matchExpressions"] == [
        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["models"]}
    ]
    # The peer selects the router pods and not the operator's.
    router = next(o for o in select(objs, "Deployment") if "router" in o["metadata"]["name"])
    router_labels = router["spec"]["template"]["metadata"]["labels"]
    selector = peer["podSelector"]["matchLabels"]
    assert selector.items() <= router_labels.items()
    operator_labels = one([o for o in select(objs, "Deployment") if o is not router], "Deployment")[
        "spec"
    ]["template"]["metadata"]["labels"]
    assert not selector.items() <= operator_labels.items()


def test_network_policy_http_closed_without_clients() -> None:
    values = {"networkPolicy": {"httpFromSameNamespace": False}}
    policy = one(render(values), "NetworkPolicy")
    assert len(policy["spec"]["ingress"]) == 1


def test_network_policy_http_sources() -> None:
    apps = {"namespaceSelector": {"matchLabels": {"team": "apps"}}}
    values = {"networkPolicy": {"httpFromSameNamespace": False, "httpIngressFrom": [apps]}}
    policy = one(render(values), "NetworkPolicy")
    assert _http_rule(policy)["from"] == [apps]
    # HTTP sources do not reach the control channel.
    assert apps not in _policy_ingress(policy)["from"]


def test_network_policy_per_served_namespace_with_extra_sources() -> None:
    gateway = {"podSelector": {"matchLabels": {"app": "gateway"}}}
    values = {
        "watch": {"namespaces": ["team-a", "team-b"]},
        "networkPolicy": {"workerPorts": [50051, 50052], "extraIngressFrom": [gateway]},
    }
    policies = select(render(values), "NetworkPolicy")
    assert sorted(p["metadata"]["namespace"] for p in policies) == ["team-a", "team-b"]
    for policy in policies:
        rule = _policy_ingress(policy)
        assert rule["from"][1:] == [gateway]
        assert [p["port"] for p in rule["ports"]] == [50051, 50052]
        # Inference clients reach the HTTP API too.
        assert gateway in _http_rule(policy)["from"]


def test_network_policy_namespaces_override() -> None:
    values = {"networkPolicy": {"namespaces": ["models"]}}
    policies = select(render(values), "NetworkPolicy")
    assert [p["metadata"]["namespace"] for p in policies] == ["models"]


def test_network_policy_off() -> None:
    assert select(render({"networkPolicy": {"enabled": False}}), "NetworkPolicy") == []


def test_metrics_service_selects_the_operator_pod() -> None:
    objs = render()
    service = one(objs, "Service")
    assert service["spec"]["type"] == "ClusterIP"
    assert service["spec"]["ports"] == [
        {"name": "http-metrics", "port": 8080, "targetPort": "http-metrics", "protocol": "TCP"}
    ]
    pod_labels = one(objs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert select(objs, "ServiceMonitor") == [], "ServiceMonitor is off by default"


def test_service_monitor_on() -> None:
    values = {
        "metrics": {
            "serviceMonitor": {
                "enabled": True,
                "interval": "15s",
                "scrapeTimeout": "5s",
                "labels": {"release": "prom"},
            }
        }
    }
    objs = render(values)
    monitor = one(objs, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["endpoints"] == [
        {"port": "http-metrics", "path": "/metrics", "interval": "15s", "scrapeTimeout": "5s"}
    ]
    service = one(objs, "Service")
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}


def test_service_monitor_without_service_is_refused() -> None:
    values = {"metrics": {"service": {"enabled": False}, "serviceMonitor": {"enabled": True}}}
    assert "metrics.service.enabled" in render_error(values)


def test_peering_on_cluster_wide() -> None:
    objs = render({"peering": {"enabled": True}}, api_versions=PEERING_APIS)
    peering = one(objs, "ClusterKopfPeering")
    assert peering["apiVersion"] == "kopf.dev/v1"
    assert peering["metadata"]["name"] == FULLNAME
    assert f"--peering={FULLNAME}" in _args(objs)
    assert select(objs, "KopfPeering") == []


def test_peering_on_namespaced_creates_one_per_namespace() -> None:
    values = {
        "peering": {"enabled": True, "name": "shared"},
        "rbac": {"scope": "Namespaced"},
        "watch": {"namespaces": ["team-a", "team-b"]},
    }
    objs = render(values, api_versions=PEERING_APIS)
    peerings = select(objs, "KopfPeering")
    assert sorted(p["metadata"]["namespace"] for p in peerings) == ["team-a", "team-b"]
    assert {p["metadata"]["name"] for p in peerings} == {"shared"}
    assert "--peering=shared" in _args(objs)


def test_peering_without_kopf_crds_is_refused_with_the_fix() -> None:
    err = render_error({"peering": {"enabled": True}})
    assert "files/kopf-peering-crds.yaml" in err


def test_peering_crds_file_defines_both_kinds() -> None:
    import yaml

    docs = list(yaml.safe_load_all((CHART_DIR / "files" / "kopf-peering-crds.yaml").read_text()))
    kinds = {(d["spec"]["names"]["kind"], d["spec"]["scope"]) for d in docs}
    assert kinds == {("ClusterKopfPeering", "Cluster"), ("KopfPeering", "Namespaced")}


def test_every_object_carries_the_chart_labels() -> None:
    objs = render(
        {"peering": {"enabled": True}, "metrics": {"serviceMonitor": {"enabled": True}}},
        api_versions=PEERING_APIS,
    )
    for obj in objs:
        labels = obj["metadata"].get("labels", {})
        assert labels.get("app.kubernetes.io/instance") == RELEASE, obj["metadata"]["name"]
        assert labels.get("app.kubernetes.io/managed-by") == "Helm", obj["metadata"]["name"]


def test_rendered_args_are_accepted_by_the_operator() -> None:
    """The chart's flags parse with the operator's own parser into the values given."""
    from omnistage_operator.k8s.settings import parse_settings

    values = {
        "rbac": {"scope": "Namespaced"},
        "watch": {"namespaces": ["team-a", "team-b"]},
        "ports": {"metrics": 9090, "liveness": 9091},
        "operator": {
            "placement": "explicit",
            "sleepTimeoutSeconds": 7,
            "ackRetries": 4,
            "roundWaitSeconds": 2,
        },
        "workerTLS": {"caSecret": "worker-ca"},
    }
    objs = render({**values, "peering": {"enabled": True, "name": "p"}}, api_versions=PEERING_APIS)
    settings = parse_settings(_args(objs), environ={})
    assert settings.namespaces == ("team-a", "team-b")
    assert settings.worker_token_file == "/var/run/secrets/omnistage/token"
    assert settings.worker_tls_ca == "/var/run/secrets/omnistage-tls/ca.crt"
    assert (settings.metrics_port, settings.liveness_port) == (9090, 9091)
    assert settings.peering == "p"
    assert settings.placement == "explicit"
    assert settings.device_class == "gpu.nvidia.com"
    assert (settings.sleep_timeout_s, settings.wake_timeout_s) == (7.0, 600.0)
    assert settings.ack_retries == 4
    assert settings.round_wait_s == 2.0
    assert parse_settings(_args(render()), environ={}).peering is None, "standalone by default"


def test_router_per_group_routes_by_model() -> None:
    assert not [o for o in render() if o["metadata"]["name"].endswith("-router-demo")]
    objs = render(
        {
            "router": {
                "enabled": True,
                "groups": [{"name": "demo", "stages": ["tiny-llama", "tiny-diffusion"]}],
            }
        }
    )
    routers = [o for o in objs if "-router-" in o["metadata"]["name"]]
    assert sorted(o["kind"] for o in routers) == ["Deployment", "Service"]
    deployment = next(o for o in routers if o["kind"] == "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["omnistage-router"]
    assert container["args"] == [
        f"--namespace={NAMESPACE}",
        "--worker-port=8000",
        "--port=8080",
        "--stage=tiny-llama",
        "--stage=tiny-diffusion",
    ]
    service = next(o for o in routers if o["kind"] == "Service")
    assert service["spec"]["ports"][0]["port"] == 8080
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    refused = render_error(
        {"router": {"enabled": True, "groups": [{"name": "demo", "stages": []}]}}
    )
    assert "stages" in refused


def test_operator_has_startup_readiness_and_liveness_probes() -> None:
    container = operator_container(render())
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "http-healthz"}
    # The startup probe gives a slow start two minutes before liveness can restart it.
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] == 120


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
    # Least privilege: only the operator's ServiceAccount, only Leases, only the release namespace.
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
            "namespaces": [NAMESPACE],
        }
    ]
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
