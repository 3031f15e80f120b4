"""The chart installed other ways on the real local control plane: namespaced scope, an upgrade
and an uninstall, kopf peering."""

from __future__ import annotations

import pytest

from tests.cluster.controlplane import ControlPlane
from tests.cluster.procs import wait_for
from tests.e2e.helm_access import access_check, lease_rules
from tests.e2e.test_helm_support import (
    CRD_NAME,
    access_reviews,
    get_json,
    install_chart,
    stage_manifest,
    uninstall_chart,
    upgrade_chart,
    worker_token,
)
from tests.unit.test_chart_rbac import CLUSTER_PEERING, FRAMEWORK_RULES, STAGE_RULES
from tests.unit.test_chart_support import CHART_DIR

pytestmark = pytest.mark.cluster


def test_namespaced_scope_stays_in_its_namespaces(control_plane: ControlPlane) -> None:
    served = [control_plane.create_namespace("team") for _ in range(2)]
    other = control_plane.create_namespace("other")
    values = {"rbac": {"scope": "Namespaced"}, "watch": {"namespaces": served}}
    release = install_chart(control_plane, values)
    try:
        grants = sorted(STAGE_RULES)
        for ns in served:
            allowed = access_reviews(
                control_plane, release.user, [access_check(rule, ns) for rule in grants]
            )
            missing = [r for r, ok in zip(grants, allowed, strict=True) if not ok]
            assert missing == [], f"{ns}: missing {missing}"
        # Nothing of the stage rules outside the served namespaces, nor cluster-wide; in the
        # release namespace only the leader election's Events on its Lease.
        lease_grants = set(lease_rules(release))
        for ns in (other, release.namespace, ""):
            allowed = access_reviews(
                control_plane, release.user, [access_check(rule, ns) for rule in grants]
            )
            leaked = [r for r, ok in zip(grants, allowed, strict=True) if ok]
            if ns == release.namespace:
                leaked = [r for r in leaked if r not in lease_grants]
            assert leaked == [], f"namespace {ns or '(all)'}: {leaked}"
        framework = sorted(FRAMEWORK_RULES)
        assert all(
            access_reviews(control_plane, release.user, [access_check(r, "") for r in framework])
        )
    finally:
        uninstall_chart(control_plane, release)
        control_plane.kubectl(
            "delete", "secret", release.token_secret, "-n", release.namespace, check=False
        )
        for ns in [*served, other, release.namespace]:
            control_plane.delete_namespace(ns)


def test_upgrade_keeps_the_token_and_uninstall_keeps_user_data(
    control_plane: ControlPlane,
) -> None:
    release = install_chart(control_plane)
    stages = control_plane.create_namespace("stages")
    try:
        token = worker_token(control_plane, release)

        upgrade_chart(control_plane, release, {"operator": {"ackRetries": 5}})
        deployment = get_json(
            control_plane, "deployment", release.fullname, "-n", release.namespace
        )
        args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        assert "--ack-retries=5" in args, "the upgrade was not applied"
        assert worker_token(control_plane, release) == token, "helm upgrade changed the token"

        control_plane.wait_crd_established(CRD_NAME)
        control_plane.kubectl("create", "-f", "-", input=stage_manifest("kept", stages, "keep"))

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
        deployment = get_json(
            control_plane, "deployment", release.fullname, "-n", release.namespace
        )
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        assert "--peering=e2e-peering" in container["args"]
        peering = [access_check(rule, "") for rule in sorted(CLUSTER_PEERING)]
        assert all(access_reviews(control_plane, release.user, peering))
        denied = {"group": "kopf.dev", "resource": "clusterkopfpeerings", "verb": "delete"}
        assert access_reviews(control_plane, release.user, [denied]) == [False]
    finally:
        uninstall_chart(control_plane, release)
        control_plane.kubectl(
            "delete", "secret", release.token_secret, "-n", release.namespace, check=False
        )
        control_plane.delete_namespace(release.namespace)
