"""Install the omnistage-operator chart into the local control plane, and act as its identity.

For the helm e2e tests and for the full hand-over test that runs the operator under the chart's
ServiceAccount (not the admin identity)::

    release = install_chart(control_plane, values={"watch": {"namespaces": [ns]}})
    kubeconfig = operator_kubeconfig(control_plane, release)    # token of the chart's SA
    token_file = worker_token_file(control_plane, release, tmp_path)
    # run `omnistage-operator --worker-token-file=<token_file> ...` with KUBECONFIG=kubeconfig

The chart's Deployment is pinned to a node label no node has (``PARKED``), so its pod stays
Pending: no image exists here, and localnode must not try to run the operator. The operator
process the tests run plays that pod, with the same ServiceAccount and token.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.cluster.controlplane import ControlPlane
from tests.cluster.kubeconfig import auth_context, load_kubeconfig
from tests.unit.test_chart_support import CHART_DIR, REPO_ROOT

CRD_NAME = "omnistages.omnistage.io"
PARKED = {"omnistage.io/e2e-parked": "true"}


@dataclass(frozen=True)
class InstalledRelease:
    """A release of the chart in the control plane."""

    name: str
    namespace: str
    fullname: str
    service_account: str
    token_secret: str

    @property
    def user(self) -> str:
        """The Kubernetes user name the operator acts as."""
        return f"system:serviceaccount:{self.namespace}:{self.service_account}"


CRD_SOURCE = REPO_ROOT / "crds" / f"{CRD_NAME}.yaml"
CRD_TEMPLATE = CHART_DIR / "templates" / "crds" / f"{CRD_NAME}.yaml"


def crd_template_text(source: Path = CRD_SOURCE) -> str:
    """The chart's templated CRD as ``make generate`` writes it from ``source``."""
    script = REPO_ROOT / "crds" / "chart-template.sh"
    proc = subprocess.run(
        ["bash", str(script), os.path.relpath(source, REPO_ROOT)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    return proc.stdout


def check_chart_crd_copy() -> None:
    """The chart must carry the CRD source's templated copy (``make generate``)."""
    if not CRD_TEMPLATE.is_file() or CRD_TEMPLATE.read_text() != crd_template_text():
        pytest.fail(
            f"{CRD_TEMPLATE.relative_to(REPO_ROOT)} is missing or differs from a fresh "
            f"generation from {CRD_SOURCE.relative_to(REPO_ROOT)}: run `make generate`",
            pytrace=False,
        )


def apply_crd(control_plane: ControlPlane) -> None:
    """The CRD applied server-side (as a user with ``crds.enabled=false`` does), Established."""
    control_plane.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_SOURCE))
    control_plane.wait_crd_established(CRD_NAME)


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def helm_values_args(values: Mapping[str, Any], workdir: Path) -> list[str]:
    """``--values FILE`` for ``values`` plus the parking node selector."""
    merged = _merge({"nodeSelector": PARKED}, values)
    path = workdir / f"values-{secrets.token_hex(4)}.yaml"
    path.write_text(yaml.safe_dump(merged))
    return ["--values", str(path)]


def install_chart(
    control_plane: ControlPlane,
    values: Mapping[str, Any] | None = None,
    *,
    namespace: str | None = None,
    name: str | None = None,
    chart: Path = CHART_DIR,
    flags: Sequence[str] = (),
) -> InstalledRelease:
    """``helm install`` the chart (a new namespace and a unique release name unless given).

    The control plane is shared by many releases and tests, and one release at most may own the
    CRD: unless ``values`` set ``crds``, the release leaves it alone (``crds.enabled=false``)
    and the CRD is applied server-side first, as such a user would.
    """
    check_chart_crd_copy()
    values = dict(values or {})
    if "crds" not in values:
        values["crds"] = {"enabled": False}
        apply_crd(control_plane)
    namespace = namespace or control_plane.create_namespace("omnistage-system")
    name = name or f"omni-{secrets.token_hex(3)}"
    with tempfile.TemporaryDirectory(prefix="omnistage-values-") as tmp:
        control_plane.helm(
            "install",
            name,
            str(chart),
            "--namespace",
            namespace,
            *helm_values_args(values, Path(tmp)),
            *flags,
        )
    return describe_release(control_plane, name, namespace)


def describe_release(control_plane: ControlPlane, name: str, namespace: str) -> InstalledRelease:
    """Names of the release's objects, read from its rendered Deployment."""
    manifest = control_plane.helm("get", "manifest", name, "--namespace", namespace).stdout
    docs = [d for d in yaml.safe_load_all(manifest) if d]
    (deployment,) = [  # the operator's (router groups add Deployments of their own)
        d
        for d in docs
        if d["kind"] == "Deployment"
        and d["spec"]["selector"]["matchLabels"].get("app.kubernetes.io/component") == "operator"
    ]
    pod = deployment["spec"]["template"]["spec"]
    # workerCredentials.mode=kubernetes mounts no token Secret: token_secret is then "".
    token_volumes = [v for v in pod["volumes"] if v["name"] == "worker-token"]
    return InstalledRelease(
        name=name,
        namespace=namespace,
        fullname=deployment["metadata"]["name"],
        service_account=pod["serviceAccountName"],
        token_secret=token_volumes[0]["secret"]["secretName"] if token_volumes else "",
    )


def upgrade_chart(
    control_plane: ControlPlane,
    release: InstalledRelease,
    values: Mapping[str, Any] | None = None,
    *,
    chart: Path = CHART_DIR,
    flags: Sequence[str] = (),
) -> None:
    """``helm upgrade`` the release with ``values`` (the chart defaults otherwise; the CRD left
    alone unless ``values`` set ``crds``, as in ``install_chart``)."""
    values = dict(values or {})
    values.setdefault("crds", {"enabled": False})
    with tempfile.TemporaryDirectory(prefix="omnistage-values-") as tmp:
        control_plane.helm(
            "upgrade",
            release.name,
            str(chart),
            "--namespace",
            release.namespace,
            *helm_values_args(values, Path(tmp)),
            *flags,
        )


def uninstall_chart(control_plane: ControlPlane, release: InstalledRelease) -> None:
    """``helm uninstall`` the release (kept resources stay)."""
    control_plane.helm("uninstall", release.name, "--namespace", release.namespace, "--wait")


def worker_token(control_plane: ControlPlane, release: InstalledRelease) -> str:
    """The worker bearer token the release's Secret holds."""
    secret = json.loads(
        control_plane.kubectl(
            "get", "secret", release.token_secret, "-n", release.namespace, "-o", "json"
        ).stdout
    )
    return base64.b64decode(secret["data"]["token"]).decode()


def worker_token_file(control_plane: ControlPlane, release: InstalledRelease, into: Path) -> Path:
    """The token written where an operator process can read it (``--worker-token-file``)."""
    path = into / "worker-token"
    path.write_text(worker_token(control_plane, release))
    path.chmod(0o600)
    return path


def operator_kubeconfig(control_plane: ControlPlane, release: InstalledRelease) -> Path:
    """A kubeconfig holding a token of the chart's ServiceAccount: act exactly as the operator."""
    return control_plane.service_account_kubeconfig(release.namespace, release.service_account)


def get_as(kubeconfig: Path, path: str) -> tuple[float, httpx.Response]:
    """GET ``path`` with ``kubeconfig``'s token: seconds taken and the response (whose
    ``X-Kubernetes-PF-FlowSchema-UID`` header names the FlowSchema that served it)."""
    auth = load_kubeconfig(kubeconfig)
    start = time.monotonic()
    r = httpx.get(
        auth.server + path, verify=auth_context(auth), timeout=30,
        headers={"Authorization": f"Bearer {auth.token}", "Accept-Encoding": "identity"},
    )  # fmt: skip
    return time.monotonic() - start, r


def lease_path(release: InstalledRelease) -> str:
    """The API path of the chart's Lease."""
    ns, name = release.namespace, release.fullname
    return f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases/{name}"


def access_reviews(
    control_plane: ControlPlane, user: str, checks: list[dict[str, str]]
) -> list[bool]:
    """``allowed`` of a SubjectAccessReview per check, all sent in one kubectl call.

    Each check holds resourceAttributes keys: verb, group, resource, and optionally
    subresource, name, namespace.
    """
    sa_namespace = user.split(":")[2]
    groups = ["system:serviceaccounts", f"system:serviceaccounts:{sa_namespace}"]
    docs = [
        {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SubjectAccessReview",
            "spec": {
                "user": user,
                "groups": [*groups, "system:authenticated"],
                "resourceAttributes": check,
            },
        }
        for check in checks
    ]
    out = control_plane.kubectl(
        "create", "-o", "json", "-f", "-", input="\n---\n".join(json.dumps(d) for d in docs)
    ).stdout
    # kubectl prints one JSON document per created object, one after another.
    decoder = json.JSONDecoder()
    items: list[dict[str, Any]] = []
    pos = 0
    while out[pos:].strip():
        obj, end = decoder.raw_decode(out, out.index("{", pos))
        items.extend(obj["items"] if obj.get("kind") == "List" else [obj])
        pos = end
    assert len(items) == len(checks)
    return [bool(item["status"].get("allowed")) for item in items]


def get_json(control_plane: ControlPlane, *args: str) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(control_plane.kubectl("get", *args, "-o", "json").stdout)
    return out


def stage_manifest(name: str, namespace: str, group: str, **spec: Any) -> str:
    """A minimal OmniStage (AR, Transformers, one GPU) as JSON for ``kubectl create -f -``;
    ``spec``: more fields of its spec."""
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
                "colocation": {"group": group},
                "gpus": 1,
                **spec,
            },
        }
    )
