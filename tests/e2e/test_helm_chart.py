"""The chart on the real local control plane: install, least-privilege RBAC, upgrade, uninstall.

RBAC is proved with SubjectAccessReviews for the chart's ServiceAccount (every contract grant
allowed, a list of dangerous ones denied), and with that ServiceAccount's own token for a few
real requests. That the grants are *sufficient* for a full hand-over is proved by the hand-over
test that runs the operator with ``operator_kubeconfig`` (tests/e2e/test_helm_support.py).
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.controlplane import ControlPlane
from tests.cluster.procs import wait_for
from tests.e2e.test_helm_support import (
    CRD_NAME,
    InstalledRelease,
    access_reviews,
    install_chart,
    operator_kubeconfig,
    uninstall_chart,
    upgrade_chart,
    worker_token,
)
from tests.unit.test_chart_rbac import CLUSTER_PEERING, FRAMEWORK_RULES, LEASE_RULES, STAGE_RULES
from tests.unit.test_chart_support import CHART_DIR, Rule

pytestmark = pytest.mark.cluster

CLUSTER_SCOPED = {"customresourcedefinitions", "namespaces", "nodes", "clusterroles"}
TOKEN_SECRET = "omnistage-worker-token"


def _check(rule: Rule, namespace: str) -> dict[str, str]:
    """A SubjectAccessReview resourceAttributes for one grant."""
    group, resource, verb, name = rule
    attrs = {"group": group, "verb": verb}
    resource, _, sub = resource.partition("/")
    attrs["resource"] = resource
    if sub:
        attrs["subresource"] = sub
    if name != "*":
        attrs["name"] = name
    if resource not in CLUSTER_SCOPED and namespace:
        attrs["namespace"] = namespace
    return attrs


def _denied(namespace: str) -> list[tuple[str, dict[str, str]]]:
    """Requests the operator must never be allowed, labelled for failure messages."""
    ns = {"namespace": namespace}
    core = {"group": ""}
    cases: list[tuple[str, dict[str, str]]] = [
        ("list secrets", {**core, **ns, "verb": "list", "resource": "secrets"}),
        ("watch secrets", {**core, **ns, "verb": "watch", "resource": "secrets"}),
        ("get any secret", {**core, **ns, "verb": "get", "resource": "secrets"}),
        ("get another secret", {**core, **ns, "verb": "get", "resource": "secrets", "name": "db"}),
        ("list all secrets", {**core, "verb": "list", "resource": "secrets"}),
        (
            "get kube-system secret",
            {**core, "namespace": "kube-system", "verb": "get", "resource": "secrets", "name": "x"},
        ),
        (
            "delete the token",
            {**core, **ns, "verb": "delete", "resource": "secrets", "name": TOKEN_SECRET},
        ),
        ("delete nodes", {**core, "verb": "delete", "resource": "nodes"}),
        ("patch nodes", {**core, "verb": "patch", "resource": "nodes"}),
        ("get nodes", {**core, "verb": "get", "resource": "nodes"}),
        ("exec", {**core, **ns, "verb": "create", "resource": "pods", "subresource": "exec"}),
        ("attach", {**core, **ns, "verb": "create", "resource": "pods", "subresource": "attach"}),
        (
            "port-forward",
            {**core, **ns, "verb": "create", "resource": "pods", "subresource": "portforward"},
        ),
        ("pod logs", {**core, **ns, "verb": "get", "resource": "pods", "subresource": "log"}),
        ("update pods", {**core, **ns, "verb": "update", "resource": "pods"}),
        ("patch pods", {**core, **ns, "verb": "patch", "resource": "pods"}),
        ("deletecollection pods", {**core, **ns, "verb": "deletecollection", "resource": "pods"}),
        (
            "ephemeral containers",
            {
                **core,
                **ns,
                "verb": "patch",
                "resource": "pods",
                "subresource": "ephemeralcontainers",
            },
        ),
        ("create namespaces", {**core, "verb": "create", "resource": "namespaces"}),
        ("delete namespaces", {**core, "verb": "delete", "resource": "namespaces"}),
        ("read configmaps", {**core, **ns, "verb": "get", "resource": "configmaps"}),
        (
            "SA tokens",
            {**core, **ns, "verb": "create", "resource": "serviceaccounts", "subresource": "token"},
        ),
        (
            "create deployments",
            {**ns, "group": "apps", "verb": "create", "resource": "deployments"},
        ),
        (
            "create CRDs",
            {
                "group": "apiextensions.k8s.io",
                "verb": "create",
                "resource": "customresourcedefinitions",
            },
        ),
        (
            "delete CRDs",
            {
                "group": "apiextensions.k8s.io",
                "verb": "delete",
                "resource": "customresourcedefinitions",
            },
        ),
        (
            "create omnistages",
            {**ns, "group": "omnistage.io", "verb": "create", "resource": "omnistages"},
        ),
        (
            "delete omnistages",
            {**ns, "group": "omnistage.io", "verb": "delete", "resource": "omnistages"},
        ),
        (
            "create clusterroles",
            {"group": "rbac.authorization.k8s.io", "verb": "create", "resource": "clusterroles"},
        ),
        (
            "escalate",
            {"group": "rbac.authorization.k8s.io", "verb": "escalate", "resource": "clusterroles"},
        ),
        (
            "bind",
            {"group": "rbac.authorization.k8s.io", "verb": "bind", "resource": "clusterroles"},
        ),
        (
            "create rolebindings",
            {
                **ns,
                "group": "rbac.authorization.k8s.io",
                "verb": "create",
                "resource": "rolebindings",
            },
        ),
        ("impersonate", {**core, "verb": "impersonate", "resource": "users"}),
        (
            "patch claims",
            {**ns, "group": "resource.k8s.io", "verb": "patch", "resource": "resourceclaims"},
        ),
        (
            "write resourceslices",
            {"group": "resource.k8s.io", "verb": "patch", "resource": "resourceslices"},
        ),
        (
            "create deviceclasses",
            {"group": "resource.k8s.io", "verb": "create", "resource": "deviceclasses"},
        ),
        (
            "admission policies",
            {
                "group": "admissionregistration.k8s.io",
                "verb": "delete",
                "resource": "validatingadmissionpolicies",
            },
        ),
    ]
    return cases


@dataclass(frozen=True)
class ClusterInstall:
    release: InstalledRelease
    stages: str  # a namespace holding stages (any namespace, in cluster scope)


@pytest.fixture(scope="module")
def cluster_install(control_plane: ControlPlane) -> Iterator[ClusterInstall]:
    """The chart with default values (cluster scope), installed once for this module."""
    release = install_chart(control_plane)
    stages = control_plane.create_namespace("stages")
    yield ClusterInstall(release, stages)
    control_plane.helm("uninstall", release.name, "--namespace", release.namespace, check=False)
    control_plane.kubectl(
        "delete",
        "secret",
        release.token_secret,
        "-n",
        release.namespace,
        "--ignore-not-found",
        check=False,
    )
    control_plane.delete_namespace(stages)
    control_plane.delete_namespace(release.namespace)


def _get(control_plane: ControlPlane, *args: str) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(control_plane.kubectl("get", *args, "-o", "json").stdout)
    return out


def test_install_creates_a_locked_down_operator(
    control_plane: ControlPlane, cluster_install: ClusterInstall
) -> None:
    release = cluster_install.release
    ns = release.namespace
    deployment = _get(control_plane, "deployment", release.fullname, "-n", ns)
    spec = deployment["spec"]
    assert spec["replicas"] == 2 and spec["strategy"]["type"] == "RollingUpdate"
    affinity = spec["template"]["spec"]["affinity"]["podAntiAffinity"]
    assert affinity["preferredDuringSchedulingIgnoredDuringExecution"][0]["weight"] == 100
    # The API server accepted the hardened pod template as rendered.
    container = spec["template"]["spec"]["containers"][0]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert len(worker_token(control_plane, release)) == 48
    for kind, name, namespace in [
        ("serviceaccount", release.service_account, ns),
        ("service", f"{release.fullname}-metrics", ns),
        ("networkpolicy", f"{release.fullname}-workers", ns),
        ("clusterrole", release.fullname, ""),
        ("clusterrole", f"{release.fullname}-framework", ""),
        ("clusterrolebinding", release.fullname, ""),
        ("validatingadmissionpolicy", f"{release.fullname}-worker-token-guard", ""),
        ("crd", CRD_NAME, ""),
    ]:
        args = [kind, name] + (["-n", namespace] if namespace else [])
        assert control_plane.kubectl("get", *args, check=False).returncode == 0, (kind, name)
    control_plane.wait_crd_established(CRD_NAME)
    notes = control_plane.helm("get", "notes", release.name, "-n", ns).stdout
    assert f"kubectl -n {ns} rollout status deployment/{release.fullname}" in notes
    assert "Serving OmniStages in: every namespace (RBAC scope: Cluster)" in notes
    assert "networkPolicy.extraIngressFrom" in notes
    assert f"kubectl -n {ns} get lease {release.fullname}" in notes


def test_operator_is_granted_every_contract_verb(
    control_plane: ControlPlane, cluster_install: ClusterInstall
) -> None:
    grants = sorted(STAGE_RULES | FRAMEWORK_RULES)
    checks = [_check(rule, cluster_install.stages) for rule in grants]
    allowed = access_reviews(control_plane, cluster_install.release.user, checks)
    missing = [rule for rule, ok in zip(grants, allowed, strict=True) if not ok]
    assert missing == [], f"the chart's RBAC lacks contract grants: {missing}"


def _lease_rules(release: InstalledRelease) -> list[Rule]:
    """LEASE_RULES with the release's names (the unit tests render the default release): the
    Lease and the epoch ConfigMap named after it."""
    from tests.unit.test_chart_support import FULLNAME

    def named(name: str) -> str:
        return release.fullname + name[len(FULLNAME) :] if name.startswith(FULLNAME) else name

    return sorted((g, r, v, named(n)) for g, r, v, n in LEASE_RULES)


def test_operator_may_elect_a_leader_in_its_namespace_only(
    control_plane: ControlPlane, cluster_install: ClusterInstall
) -> None:
    release = cluster_install.release
    grants = _lease_rules(release)
    allowed = access_reviews(
        control_plane, release.user, [_check(r, release.namespace) for r in grants]
    )
    assert all(allowed), [r for r, ok in zip(grants, allowed, strict=True) if not ok]
    lease = {"group": "coordination.k8s.io", "resource": "leases"}
    ns = {"namespace": release.namespace}
    denied = [
        ("list leases", {**lease, **ns, "verb": "list"}),
        ("watch leases", {**lease, **ns, "verb": "watch"}),
        ("patch another lease", {**lease, **ns, "verb": "patch", "name": "kube-scheduler"}),
        ("get another lease", {**lease, **ns, "verb": "get", "name": "other"}),
        ("delete the lease", {**lease, **ns, "verb": "delete", "name": release.fullname}),
        ("update the lease", {**lease, **ns, "verb": "update", "name": release.fullname}),
        (
            "leases elsewhere",
            {**lease, "namespace": cluster_install.stages, "verb": "create"},
        ),
        (
            "kube-system leases",
            {**lease, "namespace": "kube-system", "verb": "patch", "name": release.fullname},
        ),
    ]
    ok = access_reviews(control_plane, release.user, [c for _, c in denied])
    assert [label for (label, _), a in zip(denied, ok, strict=True) if a] == []


def test_operator_is_denied_everything_else(
    control_plane: ControlPlane, cluster_install: ClusterInstall
) -> None:
    cases = _denied(cluster_install.stages)
    allowed = access_reviews(control_plane, cluster_install.release.user, [c for _, c in cases])
    too_much = [label for (label, _), ok in zip(cases, allowed, strict=True) if ok]
    assert too_much == [], f"the operator's ServiceAccount may do more than it needs: {too_much}"


def _kubectl_as(
    control_plane: ControlPlane, kubeconfig: Path, *args: str, input: str | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(control_plane.binaries.kubectl), f"--kubeconfig={kubeconfig}", *args],
        input=input,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_service_account_token_acts_as_the_operator(
    control_plane: ControlPlane, cluster_install: ClusterInstall
) -> None:
    release = cluster_install.release
    kubeconfig = operator_kubeconfig(control_plane, release)
    whoami = _kubectl_as(control_plane, kubeconfig, "auth", "whoami", "-o", "json")
    assert whoami.returncode == 0, whoami.stderr
    assert json.loads(whoami.stdout)["status"]["userInfo"]["username"] == release.user
    ok = _kubectl_as(control_plane, kubeconfig, "get", "omnistages", "--all-namespaces")
    assert ok.returncode == 0, ok.stderr
    for args in (
        ("get", "secrets", "-n", cluster_install.stages),
        ("get", "secrets", "-n", release.namespace),
        ("get", "nodes"),
        ("delete", "node", "gpu-node-0"),
    ):
        proc = _kubectl_as(control_plane, kubeconfig, *args)
        assert proc.returncode != 0 and "Forbidden" in proc.stderr, (args, proc.stderr)


def _secret(name: str, namespace: str, secret_type: str = "Opaque") -> str:
    meta: dict[str, object] = {"name": name, "namespace": namespace}
    if secret_type == "kubernetes.io/service-account-token":
        meta["annotations"] = {"kubernetes.io/service-account.name": "default"}
    return json.dumps(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": meta,
            "type": secret_type,
            "stringData": {"token": "x"} if secret_type == "Opaque" else {},
        }
    )


def test_worker_token_guard_blocks_service_account_token_secrets(
    control_plane: ControlPlane, cluster_install: ClusterInstall
) -> None:
    kubeconfig = operator_kubeconfig(control_plane, cluster_install.release)
    target = control_plane.create_namespace("guard")
    try:
        bad = _secret(TOKEN_SECRET, target, "kubernetes.io/service-account-token")
        # The API server loads a new admission policy asynchronously: poll until it denies.
        deadline = time.monotonic() + 60
        while True:
            proc = _kubectl_as(control_plane, kubeconfig, "create", "-f", "-", input=bad)
            if proc.returncode != 0:
                break
            control_plane.kubectl("delete", "secret", TOKEN_SECRET, "-n", target)
            assert time.monotonic() < deadline, "the worker-token guard never took effect"
            time.sleep(0.5)
        assert "may only write Opaque Secrets named omnistage-worker-token" in proc.stderr
        other = _kubectl_as(
            control_plane, kubeconfig, "create", "-f", "-", input=_secret("other", target)
        )
        assert other.returncode != 0 and "omnistage-worker-token" in other.stderr, other.stderr
        good = _kubectl_as(
            control_plane, kubeconfig, "create", "-f", "-", input=_secret(TOKEN_SECRET, target)
        )
        assert good.returncode == 0, good.stderr
        read = _kubectl_as(control_plane, kubeconfig, "get", "secret", TOKEN_SECRET, "-n", target)
        assert read.returncode == 0, read.stderr
    finally:
        control_plane.delete_namespace(target)


def test_namespaced_scope_stays_in_its_namespaces(control_plane: ControlPlane) -> None:
    served = [control_plane.create_namespace("team") for _ in range(2)]
    other = control_plane.create_namespace("other")
    values = {"rbac": {"scope": "Namespaced"}, "watch": {"namespaces": served}}
    release = install_chart(control_plane, values)
    try:
        grants = sorted(STAGE_RULES)
        for ns in served:
            allowed = access_reviews(
                control_plane, release.user, [_check(rule, ns) for rule in grants]
            )
            missing = [r for r, ok in zip(grants, allowed, strict=True) if not ok]
            assert missing == [], f"{ns}: missing {missing}"
        # Nothing of the stage rules outside the served namespaces, nor cluster-wide; in the
        # release namespace only the leader election's Events on its Lease.
        lease_grants = set(_lease_rules(release))
        for ns in (other, release.namespace, ""):
            allowed = access_reviews(
                control_plane, release.user, [_check(rule, ns) for rule in grants]
            )
            leaked = [r for r, ok in zip(grants, allowed, strict=True) if ok]
            if ns == release.namespace:
                leaked = [r for r in leaked if r not in lease_grants]
            assert leaked == [], f"namespace {ns or '(all)'}: {leaked}"
        framework = sorted(FRAMEWORK_RULES)
        assert all(access_reviews(control_plane, release.user, [_check(r, "") for r in framework]))
    finally:
        uninstall_chart(control_plane, release)
        control_plane.kubectl(
            "delete", "secret", release.token_secret, "-n", release.namespace, check=False
        )
        for ns in [*served, other, release.namespace]:
            control_plane.delete_namespace(ns)


def _omnistage(name: str, namespace: str) -> str:
    return json.dumps(
        {
            "apiVersion": "omnistage.io/v1alpha1",
            "kind": "OmniStage",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {
                "runner": "AR",
                "backend": "Transformers",
                "image": "omnistage/omnistage-worker:0.1.0",
                "model": {"path": "/models/tiny"},
                "colocation": {"group": "keep"},
                "gpus": 1,
            },
        }
    )


def test_upgrade_keeps_the_token_and_uninstall_keeps_user_data(
    control_plane: ControlPlane,
) -> None:
    release = install_chart(control_plane)
    stages = control_plane.create_namespace("stages")
    try:
        token = worker_token(control_plane, release)

        upgrade_chart(control_plane, release, {"operator": {"ackRetries": 5}})
        deployment = _get(control_plane, "deployment", release.fullname, "-n", release.namespace)
        args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        assert "--ack-retries=5" in args, "the upgrade was not applied"
        assert worker_token(control_plane, release) == token, "helm upgrade changed the token"

        control_plane.wait_crd_established(CRD_NAME)
        control_plane.kubectl("create", "-f", "-", input=_omnistage("kept", stages))

        uninstall_chart(control_plane, release)
        gone = control_plane.kubectl(
            "get", "deployment", release.fullname, "-n", release.namespace, check=False
        )
        assert gone.returncode != 0 and "NotFound" in gone.stderr
        assert control_plane.kubectl("get", "clusterrole", release.fullname, check=False).returncode
        # CRDs, users' OmniStages and the generated token survive the uninstall.
        control_plane.kubectl("get", "crd", CRD_NAME)
        control_plane.kubectl("get", "omnistage", "kept", "-n", stages)
        assert worker_token(control_plane, release) == token

        # Installing again under the same name adopts the kept Secret and its token.
        again = install_chart(control_plane, namespace=release.namespace, name=release.name)
        assert worker_token(control_plane, again) == token
        uninstall_chart(control_plane, again)
    finally:
        control_plane.helm("uninstall", release.name, "-n", release.namespace, check=False)
        control_plane.kubectl("delete", "omnistage", "kept", "-n", stages, check=False)
        control_plane.kubectl(
            "delete", "secret", release.token_secret, "-n", release.namespace, check=False
        )
        control_plane.delete_namespace(stages)
        control_plane.delete_namespace(release.namespace)


def test_peering_install_creates_the_peering_and_its_grants(control_plane: ControlPlane) -> None:
    crds = CHART_DIR / "files" / "kopf-peering-crds.yaml"
    # Shared with any other kopf operator: create only what is missing, never replace.
    for crd in ("clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"):
        if control_plane.kubectl("get", "crd", crd, check=False).returncode != 0:
            control_plane.kubectl("create", "-f", str(crds), check=False)
        control_plane.wait_crd_established(crd)
    # helm reads the API list from discovery: wait until it serves the new group.
    wait_for(
        "kopf.dev/v1 in API discovery",
        lambda: (
            control_plane.kubectl("get", "--raw", "/apis/kopf.dev/v1", check=False).returncode == 0
        ),
        30,
        interval=0.2,
    )
    release = install_chart(control_plane, {"peering": {"enabled": True, "name": "e2e-peering"}})
    try:
        control_plane.kubectl("get", "clusterkopfpeering", "e2e-peering")
        deployment = _get(control_plane, "deployment", release.fullname, "-n", release.namespace)
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        assert "--peering=e2e-peering" in container["args"]
        peering = [_check(rule, "") for rule in sorted(CLUSTER_PEERING)]
        assert all(access_reviews(control_plane, release.user, peering))
        denied = {"group": "kopf.dev", "resource": "clusterkopfpeerings", "verb": "delete"}
        assert access_reviews(control_plane, release.user, [denied]) == [False]
    finally:
        uninstall_chart(control_plane, release)
        control_plane.kubectl(
            "delete", "secret", release.token_secret, "-n", release.namespace, check=False
        )
        control_plane.delete_namespace(release.namespace)
