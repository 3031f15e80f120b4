"""What the chart's RBAC is checked with: a grant as SubjectAccessReview attributes, the requests
the operator must never be allowed, and the Lease grants under a release's own names."""

from __future__ import annotations

from tests.e2e.test_helm_support import InstalledRelease
from tests.unit.test_chart_rbac import LEASE_RULES
from tests.unit.test_chart_support import Rule

TOKEN_SECRET = "omnistage-worker-token"
CLUSTER_SCOPED = {"customresourcedefinitions", "namespaces", "nodes", "clusterroles"}


def access_check(rule: Rule, namespace: str) -> dict[str, str]:
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


def denied_requests(namespace: str) -> list[tuple[str, dict[str, str]]]:
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


def lease_rules(release: InstalledRelease) -> list[Rule]:
    """LEASE_RULES with the release's names (the unit tests render the default release): the
    Lease and the epoch ConfigMap named after it."""
    from tests.unit.test_chart_support import FULLNAME

    def named(name: str) -> str:
        return release.fullname + name[len(FULLNAME) :] if name.startswith(FULLNAME) else name

    return sorted((g, r, v, named(n)) for g, r, v, n in LEASE_RULES)
