"""The operator chart installed on the real node with the operator image built here.

``install_on_node`` runs ``helm install`` of ``charts/omnistage-operator`` with the image
``make images`` imported into the node's runtime (``imagePullPolicy: Never``: nothing is
pulled), the operator pinned to the node, serving the given namespaces. ``operator_pod`` waits
until the release's pod is Ready (its startup and readiness probes passed: kopf runs and talks
to the API server through the ``kubernetes`` Service) and returns it.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from tests.cluster.controlplane import ControlPlane
from tests.cluster.podwait import is_ready
from tests.e2e.test_helm_support import InstalledRelease, check_chart_crd_copy, describe_release
from tests.node.images import IMAGES, VERSION
from tests.unit.test_chart_support import CHART_DIR

OPERATOR_IMAGE = IMAGES["operator"]
CRD_DIR = Path(__file__).resolve().parents[2] / "crds"
PSS_ENFORCE = "pod-security.kubernetes.io/enforce"


def enforce_restricted(cp: ControlPlane, namespace: str) -> None:
    """Label ``namespace`` to enforce the restricted Pod Security Standard."""
    cp.kubectl("label", "namespace", namespace, f"{PSS_ENFORCE}=restricted", "--overwrite")


def node_values(node: str, watch: list[str]) -> dict[str, Any]:
    """Chart values: the local operator image, one replica on ``node``, serving ``watch``."""
    return {
        "image": {
            "repository": OPERATOR_IMAGE.ref.rsplit(":", 1)[0],
            "tag": VERSION,
            "pullPolicy": "Never",
        },
        "replicaCount": 1,
        "nodeSelector": {"kubernetes.io/hostname": node},
        "watch": {"namespaces": watch},
        # The CRDs are applied server-side before (apply_crds): another release or an earlier
        # test on the same control plane may already own them, which helm refuses to adopt.
        "crds": {"enabled": False},
    }


def apply_crds(cp: ControlPlane) -> None:
    """Every CRD of ``crds/`` applied server-side (as a user with ``crds.enabled=false``)."""
    cp.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_DIR))
    for crd in sorted(CRD_DIR.glob("*.yaml")):
        cp.wait_crd_established(crd.stem)


def install_on_node(
    cp: ControlPlane,
    node: str,
    namespace: str,
    watch: list[str],
    *,
    name: str = "omni",
    extra: dict[str, Any] | None = None,
) -> InstalledRelease:
    """``helm install`` the chart into ``namespace`` with :func:`node_values` (top-level keys
    of ``extra`` added or replaced)."""
    check_chart_crd_copy()
    apply_crds(cp)
    with tempfile.TemporaryDirectory(prefix="omnistage-values-") as tmp:
        values = Path(tmp) / "values.yaml"
        values.write_text(yaml.safe_dump({**node_values(node, watch), **(extra or {})}))
        cp.helm("install", name, str(CHART_DIR), "--namespace", namespace, "--values", str(values))
    return describe_release(cp, name, namespace)


def operator_pod(
    cp: ControlPlane,
    release: InstalledRelease,
    logs: Callable[[str, str], str],
    timeout: float = 240,
) -> Any:
    """The release's operator pod once Ready; on timeout or a second restart, fail with its
    container statuses and ``logs(namespace, pod)``."""
    selector = f"app.kubernetes.io/instance={release.name},app.kubernetes.io/component=operator"
    deadline = time.monotonic() + timeout
    pods: list[Any] = []
    while time.monotonic() < deadline:
        pods = cp.get_json("pods", "-l", selector, namespace=release.namespace)["items"]
        ready = [p for p in pods if is_ready(p)]
        if ready:
            return ready[0]
        if any(s.get("restartCount", 0) >= 2 for p in pods for s in _statuses(p)):
            break
        time.sleep(0.5)
    text = "\n".join(logs(release.namespace, p["metadata"]["name"]) for p in pods)
    status = json.dumps([_statuses(p) for p in pods], indent=1)[:3000]
    raise AssertionError(f"no Ready operator pod: {status}\n{text}")


def _statuses(pod: Any) -> list[Any]:
    return list((pod.get("status") or {}).get("containerStatuses") or [])
