"""The chart grants exactly the operator contract's RBAC, in both scopes, and nothing more."""

from __future__ import annotations

import pytest

from tests.unit.test_chart_support import (
    FULLNAME,
    NAMESPACE,
    Obj,
    Rule,
    flatten_rules,
    one,
    render,
    select,
)

SA = FULLNAME
PEERING_APIS = ("kopf.dev/v1/ClusterKopfPeering", "kopf.dev/v1/KopfPeering")


def _grants(group: str, resource: str, verbs: str, name: str = "*") -> set[Rule]:
    return {(group, resource, verb, name) for verb in verbs.split()}


# The operator contract, "RBAC the operator needs", one grant per (group, resource, verb, name).
STAGE_RULES: set[Rule] = (
    _grants("omnistage.io", "omnistages", "get list watch patch update")
    | _grants("omnistage.io", "omnistages/status", "get patch update")
    | _grants("omnistage.io", "omnipipelines", "get list watch")
    | _grants("omnistage.io", "omnipipelines/status", "get patch")
    | _grants("", "pods", "get list watch create delete")
    | _grants("", "services", "get list watch create delete patch")
    | _grants("", "secrets", "create")
    | _grants("", "secrets", "get patch update", "omnistage-worker-token")
    | _grants("", "events", "create patch")
    | _grants("events.k8s.io", "events", "create patch")
    | _grants("resource.k8s.io", "resourceclaims", "get list watch create delete")
)
# Namespace claims (with leader election, the default): in every served namespace, create (not
# limitable by name), read and conditional writes of the one claim Lease; no list, no delete.
CLAIM_RULES: set[Rule] = _grants("coordination.k8s.io", "leases", "create") | _grants(
    "coordination.k8s.io", "leases", "get patch", "omnistage-namespace-claim"
)
STAGE_RULES |= CLAIM_RULES
FRAMEWORK_RULES: set[Rule] = (
    _grants("apiextensions.k8s.io", "customresourcedefinitions", "list watch")
    | _grants("", "namespaces", "list watch")
    | _grants("resource.k8s.io", "resourceslices", "list")
)
# Leader election, in the release namespace only: create (not limitable by name), read and
# conditional writes of the one Lease and of the ConfigMap that keeps its last epoch, Events.
LEASE_RULES: set[Rule] = (
    _grants("coordination.k8s.io", "leases", "create")
    | _grants("coordination.k8s.io", "leases", "get patch", FULLNAME)
    | _grants("", "configmaps", "create")
    | _grants("", "configmaps", "get patch", f"{FULLNAME}-epoch")
    | _grants("", "events", "create")
)
CLUSTER_PEERING: set[Rule] = _grants("kopf.dev", "clusterkopfpeerings", "get list watch patch")
NAMESPACED_PEERING: set[Rule] = _grants("kopf.dev", "kopfpeerings", "get list watch patch")


AGGREGATE = "rbac.authorization.k8s.io/aggregate-to-"


def _aggregated(role: Obj) -> bool:
    """A user-facing role aggregated into view/edit/admin, not one of the operator's."""
    labels: dict[str, str] = role["metadata"].get("labels", {})
    return any(key.startswith(AGGREGATE) for key in labels)


def _by_name(objs: list[Obj], kind: str) -> dict[str, Obj]:
    return {o["metadata"]["name"]: o for o in select(objs, kind) if not _aggregated(o)}


def _assert_bound_to_operator(binding: Obj, role_kind: str, role_name: str) -> None:
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": role_kind,
        "name": role_name,
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": SA, "namespace": NAMESPACE}]


def _all_rules(objs: list[Obj]) -> list[Obj]:
    rules: list[Obj] = []
    for kind in ("ClusterRole", "Role"):
        for role in select(objs, kind):
            rules.extend(role["rules"])
    return rules


def test_cluster_scope_grants_exactly_the_contract() -> None:
    objs = render()
    roles = _by_name(objs, "ClusterRole")
    assert set(roles) == {FULLNAME, f"{FULLNAME}-framework"}
    assert flatten_rules(roles[FULLNAME]["rules"]) == STAGE_RULES
    assert flatten_rules(roles[f"{FULLNAME}-framework"]["rules"]) == FRAMEWORK_RULES
    bindings = _by_name(objs, "ClusterRoleBinding")
    assert set(bindings) == set(roles)
    for name, binding in bindings.items():
        _assert_bound_to_operator(binding, "ClusterRole", name)
    _assert_only_the_lease_role(objs)


def _assert_only_the_lease_role(objs: list[Obj], namespaced: tuple[str, ...] = ()) -> None:
    """The leader-election Role is the only Role in the release namespace, bound to the SA."""
    name = f"{FULLNAME}-leader-election"
    roles = [r for r in select(objs, "Role") if r["metadata"]["namespace"] not in namespaced]
    assert [(r["metadata"]["name"], r["metadata"]["namespace"]) for r in roles] == [
        (name, NAMESPACE)
    ]
    assert flatten_rules(roles[0]["rules"]) == LEASE_RULES
    bindings = [b for b in select(objs, "RoleBinding") if b["metadata"]["name"] == name]
    assert [b["metadata"]["namespace"] for b in bindings] == [NAMESPACE]
    _assert_bound_to_operator(bindings[0], "Role", name)


def test_lease_is_limited_by_name_and_namespace() -> None:
    objs = render()
    (role,) = [r for r in select(objs, "Role") if r["metadata"]["name"].endswith("-election")]
    for rule in role["rules"]:
        if rule["resources"] == ["leases"] and rule["verbs"] != ["create"]:
            assert rule["resourceNames"] == [FULLNAME]
    # The operator is told the same name.
    container = one(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert f"--lease-name={FULLNAME}" in container["args"]
    assert select(render({"leaderElection": {"enabled": False}, "replicaCount": 1}), "Role") == []


def test_namespaced_scope_has_one_role_per_namespace() -> None:
    values = {"rbac": {"scope": "Namespaced"}, "watch": {"namespaces": ["team-a", "team-b"]}}
    objs = render(values)
    roles = [r for r in select(objs, "Role") if r["metadata"]["name"] == FULLNAME]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    for role in roles:
        assert flatten_rules(role["rules"]) == STAGE_RULES
    bindings = [b for b in select(objs, "RoleBinding") if b["metadata"]["name"] == FULLNAME]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    _assert_only_the_lease_role(objs, ("team-a", "team-b"))
    for binding in bindings:
        _assert_bound_to_operator(binding, "Role", FULLNAME)
    # Only kopf's cluster-scoped reads remain cluster-wide (beside the users' aggregated roles).
    (cluster_role,) = _by_name(objs, "ClusterRole").values()
    assert flatten_rules(cluster_role["rules"]) == FRAMEWORK_RULES


def test_namespace_claims_need_only_the_claim_lease_and_only_with_election() -> None:
    for values in ({}, {"rbac": {"scope": "Namespaced"}, "watch": {"namespaces": ["team-a"]}}):
        roles = [r for r in _all_rules_by_name(render(values)) if r[0] == FULLNAME]
        for _, rules in roles:
            leases = {g for g in flatten_rules(rules) if g[1] == "leases"}
            assert leases == CLAIM_RULES
    off = {"leaderElection": {"enabled": False}, "replicaCount": 1}
    for values in (off, {**off, "rbac": {"scope": "Namespaced"}}):
        for name, rules in _all_rules_by_name(render(values)):
            assert not {g for g in flatten_rules(rules) if g[1] == "leases"}
            if name == FULLNAME:
                assert flatten_rules(rules) == STAGE_RULES - CLAIM_RULES


def _all_rules_by_name(objs: list[Obj]) -> list[tuple[str, list[Obj]]]:
    return [
        (role["metadata"]["name"], role["rules"])
        for kind in ("ClusterRole", "Role")
        for role in select(objs, kind)
        if not _aggregated(role)
    ]


def test_namespaced_scope_defaults_to_the_release_namespace() -> None:
    roles = select(render({"rbac": {"scope": "Namespaced"}}), "Role")
    assert sorted(
        r["metadata"]["name"] for r in roles if r["metadata"]["namespace"] == NAMESPACE
    ) == [
        FULLNAME,
        f"{FULLNAME}-leader-election",
    ]


def test_peering_adds_only_the_peering_grants() -> None:
    objs = render({"peering": {"enabled": True}}, api_versions=PEERING_APIS)
    roles = _by_name(objs, "ClusterRole")
    assert flatten_rules(roles[FULLNAME]["rules"]) == STAGE_RULES
    assert flatten_rules(roles[f"{FULLNAME}-framework"]["rules"]) == (
        FRAMEWORK_RULES | CLUSTER_PEERING
    )

    values = {
        "peering": {"enabled": True},
        "rbac": {"scope": "Namespaced"},
        "watch": {"namespaces": ["team-a"]},
    }
    objs = render(values, api_versions=PEERING_APIS)
    (role,) = [r for r in select(objs, "Role") if r["metadata"]["name"] == FULLNAME]
    assert flatten_rules(role["rules"]) == STAGE_RULES | NAMESPACED_PEERING
    (framework,) = _by_name(objs, "ClusterRole").values()
    assert flatten_rules(framework["rules"]) == FRAMEWORK_RULES


@pytest.mark.parametrize(
    "values",
    [
        {},
        {"rbac": {"scope": "Namespaced"}, "watch": {"namespaces": ["a", "b"]}},
        {"peering": {"enabled": True}},
    ],
    ids=["cluster", "namespaced", "peering"],
)
def test_no_wildcards_and_secrets_limited_by_name(values: Obj) -> None:
    rules = _all_rules(render(values, api_versions=PEERING_APIS))
    assert rules
    for rule in rules:
        for key in ("apiGroups", "resources", "verbs", "resourceNames"):
            assert "*" not in rule.get(key, []), f"wildcard in {key}: {rule}"
        assert "nonResourceURLs" not in rule
    for group, resource, verb, name in flatten_rules(rules):
        if resource == "secrets":
            # RBAC cannot limit create by name; every other verb is limited to the token.
            assert verb == "create" or name == "omnistage-worker-token", (verb, name)
            assert verb not in {"list", "watch", "delete", "deletecollection"}
        assert resource not in {"pods/exec", "pods/attach", "pods/portforward", "nodes"}
        assert verb not in {"escalate", "bind", "impersonate", "deletecollection"}
        assert (group, resource) != ("rbac.authorization.k8s.io", "clusterroles")


def test_rules_are_commented_by_purpose() -> None:
    from tests.unit.test_chart_support import CHART_DIR

    text = (CHART_DIR / "templates" / "_rbac.tpl").read_text()
    blocks = text.split("- apiGroups:")[1:]
    preceding = text.split("- apiGroups:")[:-1]
    assert blocks
    for before in preceding:
        # Each rule (or pair of rules on one resource) follows a "# purpose" comment line.
        tail = [ln.strip() for ln in before.strip().splitlines()][-1]
        assert tail.startswith("#") or tail.startswith("verbs:"), tail


def test_rbac_off_renders_no_rbac() -> None:
    objs = render({"rbac": {"create": False}})
    for kind in ("ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"):
        assert select(objs, kind) == []
    assert select(objs, "ValidatingAdmissionPolicy") == []


def test_service_account_is_the_deployments() -> None:
    objs = render()
    sa = one(objs, "ServiceAccount")
    assert sa["metadata"] == {**sa["metadata"], "name": SA, "namespace": NAMESPACE}
    # The token is mounted only into the operator pod, not into anything else using the SA.
    assert sa["automountServiceAccountToken"] is False
    pod = one(objs, "Deployment")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == SA
    assert pod["automountServiceAccountToken"] is True


def test_existing_service_account_needs_a_name() -> None:
    from tests.unit.test_chart_support import render_error

    err = render_error({"serviceAccount": {"create": False}})
    assert "serviceAccount.name" in err
    objs = render({"serviceAccount": {"create": False, "name": "mine"}})
    assert select(objs, "ServiceAccount") == []
    assert one(objs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "mine"


def test_worker_token_guard_restricts_the_operator_secret_writes() -> None:
    objs = render()
    policy = one(objs, "ValidatingAdmissionPolicy")
    binding = one(objs, "ValidatingAdmissionPolicyBinding")
    assert binding["spec"] == {
        "policyName": policy["metadata"]["name"],
        "validationActions": ["Deny"],
    }
    spec = policy["spec"]
    assert spec["failurePolicy"] == "Fail"
    assert spec["matchConstraints"]["resourceRules"] == [
        {
            "apiGroups": [""],
            "apiVersions": ["v1"],
            "operations": ["CREATE", "UPDATE"],
            "resources": ["secrets"],
        }
    ]
    (condition,) = spec["matchConditions"]
    assert f'"system:serviceaccount:{NAMESPACE}:{SA}"' in condition["expression"]
    (validation,) = spec["validations"]
    assert '"omnistage-worker-token"' in validation["expression"]
    assert 'object.type == "Opaque"' in validation["expression"]
    assert select(render({"rbac": {"workerTokenGuard": False}}), "ValidatingAdmissionPolicy") == []


def test_users_get_omnistage_in_the_default_roles() -> None:
    objs = render()
    roles = {o["metadata"]["name"]: o for o in select(objs, "ClusterRole") if _aggregated(o)}
    view, edit = roles[f"{FULLNAME}-view"], roles[f"{FULLNAME}-edit"]
    view_labels = {
        k[len(AGGREGATE) :] for k in view["metadata"]["labels"] if k.startswith(AGGREGATE)
    }
    edit_labels = {
        k[len(AGGREGATE) :] for k in edit["metadata"]["labels"] if k.startswith(AGGREGATE)
    }
    assert view_labels == {"view", "edit", "admin"}
    assert edit_labels == {"edit", "admin"}
    read = "get list watch"
    assert flatten_rules(view["rules"]) == (
        _grants("omnistage.io", "omnistages", read)
        | _grants("omnistage.io", "omnistages/status", read)
        | _grants("omnistage.io", "omnipipelines", read)
        | _grants("omnistage.io", "omnipipelines/status", read)
    )
    assert flatten_rules(edit["rules"]) == _grants(
        "omnistage.io", "omnistages", "create update patch delete"
    ) | _grants("omnistage.io", "omnipipelines", "create update patch delete")
    # Status is written by the operator alone, and nothing binds these roles to it.
    assert not any(
        g[1] in ("omnistages/status", "omnipipelines/status")
        and g[2] != "get"
        and g[2] not in ("list", "watch")
        for g in flatten_rules(view["rules"]) | flatten_rules(edit["rules"])
    )
    bound = {b["roleRef"]["name"] for b in select(objs, "ClusterRoleBinding")}
    assert not bound & set(roles)
    off = render({"rbac": {"aggregateToDefaultRoles": False}})
    assert not [o for o in select(off, "ClusterRole") if _aggregated(o)]
