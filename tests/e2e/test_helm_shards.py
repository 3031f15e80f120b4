"""Shards as chart releases on the real API server: two releases of the chart in one namespace,
each serving its own namespace (namespaced RBAC), install side by side (helm refuses an object
another release owns) and each one's ServiceAccount reaches only its namespace and its Lease."""

from __future__ import annotations

import secrets

import pytest

from tests.cluster.controlplane import ControlPlane
from tests.e2e.helm_access import access_check, lease_rules
from tests.e2e.test_helm_support import (
    InstalledRelease,
    access_reviews,
    install_chart,
    uninstall_chart,
)
from tests.unit.test_chart_rbac import STAGE_RULES

pytestmark = pytest.mark.cluster


def test_two_shard_releases_install_side_by_side_each_confined_to_its_shard(
    control_plane: ControlPlane,
) -> None:
    cp = control_plane
    system = cp.create_namespace("omnistage-system")
    served = [cp.create_namespace(f"shard{k}") for k in range(2)]
    tag = secrets.token_hex(2)
    releases: list[InstalledRelease] = []
    try:
        for k, ns in enumerate(served):
            values = {"rbac": {"scope": "Namespaced"}, "watch": {"namespaces": [ns]}}
            releases.append(install_chart(cp, values, namespace=system, name=f"shard{k}-{tag}"))
        assert releases[0].fullname != releases[1].fullname
        grants = sorted(STAGE_RULES)
        for k, release in enumerate(releases):
            other = releases[1 - k]
            mine = access_reviews(cp, release.user, [access_check(r, served[k]) for r in grants])
            assert all(mine), [r for r, ok in zip(grants, mine, strict=True) if not ok]
            theirs = access_reviews(
                cp, release.user, [access_check(r, served[1 - k]) for r in grants]
            )
            assert not any(theirs), [r for r, ok in zip(grants, theirs, strict=True) if ok]
            # its own Lease and epoch record; not the other shard's (those granted by name)
            own = lease_rules(release)
            assert all(access_reviews(cp, release.user, [access_check(r, system) for r in own]))
            named = [r for r in lease_rules(other) if r[3] != "*"]
            assert named, lease_rules(other)
            denied = access_reviews(cp, release.user, [access_check(r, system) for r in named])
            assert not any(denied), [r for r, ok in zip(named, denied, strict=True) if ok]
    finally:
        for release in releases:
            uninstall_chart(cp, release)
            cp.kubectl("delete", "secret", release.token_secret, "-n", system, check=False)
        for ns in [*served, system]:
            cp.delete_namespace(ns)
