"""The chart installed with its defaults on the real local control plane: what it creates, and its
least-privilege RBAC (other installs, an upgrade and an uninstall: test_helm_releases.py).

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

import pytest

from omnistage_operator.decisions.namespace_claims import CLAIM_NAME
from tests.cluster.controlplane import ControlPlane
from tests.e2e.helm_access import TOKEN_SECRET, access_check, denied_requests, lease_rules
from tests.e2e.test_helm_support import (
    CRD_NAME,
    InstalledRelease,
    access_reviews,
    get_json,
    install_chart,
    operator_kubeconfig,
    worker_token,
)
from tests.unit.test_chart_rbac import FRAMEWORK_RULES, STAGE_RULES

pytestmark = pytest.mark.cluster


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


def test_install_creates_a_locked_down_operator(
    control_plane: ControlPlane, cluster_install: ClusterInstall
) -> None:
    release = cluster_install.release
    ns = release.namespace
    deployment = get_json(control_plane, "deployment", release.fullname, "-n", ns)
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
    checks = [access_check(rule, cluster_install.stages) for rule in grants]
    allowed = access_reviews(control_plane, cluster_install.release.user, checks)
    missing = [rule for rule, ok in zip(grants, allowed, strict=True) if not ok]
    assert missing == [], f"the chart's RBAC lacks contract grants: {missing}"


def test_operator_may_elect_a_leader_in_its_namespace_only(
    control_plane: ControlPlane, cluster_install: ClusterInstall
) -> None:
    release = cluster_install.release
    grants = lease_rules(release)
    allowed = access_reviews(
        control_plane, release.user, [access_check(r, release.namespace) for r in grants]
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
        # in the stages' namespaces only the namespace claim (create cannot name a Lease)
        (
            "patch another lease where stages live",
            {
                **lease,
                "namespace": cluster_install.stages,
                "verb": "patch",
                "name": release.fullname,
            },
        ),
        (
            "delete the namespace claim",
            {**lease, "namespace": cluster_install.stages, "verb": "delete", "name": CLAIM_NAME},
        ),
        (
            "list leases where stages live",
            {**lease, "namespace": cluster_install.stages, "verb": "list"},
        ),
        (
            "kube-system leases",
            {**lease, "namespace": "kube-system", "verb": "patch", "name": release.fullname},
        ),
    ]
    ok = access_reviews(control_plane, release.user, [c for _, c in denied])
    assert [label for (label, _), a in zip(denied, ok, strict=True) if a] == []
    claim = {**lease, "namespace": cluster_install.stages, "name": CLAIM_NAME}
    verbs = ("create", "get", "patch")
    claims = access_reviews(control_plane, release.user, [{**claim, "verb": v} for v in verbs])
    assert all(claims), dict(zip(verbs, claims, strict=True))


def test_operator_is_denied_everything_else(
    control_plane: ControlPlane, cluster_install: ClusterInstall
) -> None:
    cases = denied_requests(cluster_install.stages)
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
