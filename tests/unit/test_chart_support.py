"""Render the omnistage-operator chart with the project's helm binary and pick objects out.

Shared by the chart tests (tests/unit/test_chart_*.py) and the helm e2e tests. helm comes from
the control-plane build (``python -m tests.cluster.build``); when it is not built the tests
FAIL with that instruction rather than skip. ``OMNISTAGE_TEST_HELM`` may point at another helm
binary while working on the chart alone; CI never sets it.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.cluster.build import BuildError, find_binaries

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = REPO_ROOT / "charts" / "omnistage-operator"
# The chart's kubeVersion floor is 1.34; render as the control plane the tests run (1.36).
KUBE_VERSION = "1.36.0"
RELEASE = "omnistage-operator"
# The release name contains the chart name, so objects are named after the release alone.
FULLNAME = RELEASE
NAMESPACE = "omnistage-system"
# The kopf peering CRDs, as a cluster that has them installed offers them to helm.
PEERING_APIS = ("kopf.dev/v1/ClusterKopfPeering", "kopf.dev/v1/KopfPeering")

Obj = dict[str, Any]


def helm_binary() -> Path:
    """The project's helm binary; fails the calling test with the build command if missing."""
    override = os.environ.get("OMNISTAGE_TEST_HELM")
    if override:
        return Path(override)
    try:
        return find_binaries().helm
    except BuildError as exc:
        problem = str(exc)
    pytest.fail(f"helm is needed to render the chart: {problem}", pytrace=False)


def run_helm(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run helm with an isolated home, so no user repository or plugin takes part."""
    with tempfile.TemporaryDirectory(prefix="omnistage-helm-") as home:
        env = dict(os.environ)
        env.update(
            HELM_CACHE_HOME=f"{home}/cache",
            HELM_CONFIG_HOME=f"{home}/config",
            HELM_DATA_HOME=f"{home}/data",
        )
        return subprocess.run(
            [str(helm_binary()), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            check=False,
        )


def _template(
    values: Mapping[str, Any] | None,
    namespace: str,
    release: str,
    api_versions: Iterable[str],
) -> subprocess.CompletedProcess[str]:
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="values-") as fh:
        yaml.safe_dump(dict(values or {}), fh)
        fh.flush()
        args = [
            "template",
            release,
            str(CHART_DIR),
            "--namespace",
            namespace,
            "--kube-version",
            KUBE_VERSION,
            "--values",
            fh.name,
        ]
        for api in api_versions:
            args += ["--api-versions", api]
        return run_helm(*args)


def render(
    values: Mapping[str, Any] | None = None,
    *,
    namespace: str = NAMESPACE,
    release: str = RELEASE,
    api_versions: Iterable[str] = (),
) -> list[Obj]:
    """The objects ``helm template`` renders for ``values`` (parsed YAML, empty documents out)."""
    proc = _template(values, namespace, release, api_versions)
    if proc.returncode != 0:
        pytest.fail(f"helm template failed for values {values!r}:\n{proc.stderr}", pytrace=False)
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def render_error(
    values: Mapping[str, Any],
    *,
    namespace: str = NAMESPACE,
    api_versions: Iterable[str] = (),
) -> str:
    """helm's error output for ``values``, which must be refused."""
    proc = _template(values, namespace, RELEASE, api_versions)
    assert proc.returncode != 0, f"helm template accepted values it should refuse: {values!r}"
    return proc.stderr


def select(objs: Iterable[Obj], kind: str, namespace: str | None = None) -> list[Obj]:
    """Objects of ``kind`` (in ``namespace`` when given)."""
    return [
        o
        for o in objs
        if o["kind"] == kind and (namespace is None or o["metadata"].get("namespace") == namespace)
    ]


def one(objs: Iterable[Obj], kind: str, namespace: str | None = None) -> Obj:
    """The single object of ``kind``; fails when there are none or several."""
    found = select(objs, kind, namespace)
    assert len(found) == 1, f"expected one {kind}, found {[o['metadata']['name'] for o in found]}"
    return found[0]


def operator_container(objs: Iterable[Obj]) -> Obj:
    """The operator container of the rendered Deployment."""
    containers: list[Obj] = one(objs, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["operator"]
    return containers[0]


def pod_spec(objs: Iterable[Obj]) -> Obj:
    """The pod spec of the rendered operator Deployment."""
    spec: Obj = one(objs, "Deployment")["spec"]["template"]["spec"]
    return spec


def operator_args(objs: Iterable[Obj]) -> list[str]:
    """The operator container's command-line arguments."""
    args: list[str] = operator_container(objs)["args"]
    return args


Rule = tuple[str, str, str, str]  # (apiGroup, resource, verb, resourceName or "*")


def flatten_rules(rules: Iterable[Obj]) -> set[Rule]:
    """Each PolicyRule as the set of single grants it makes."""
    grants: set[Rule] = set()
    for rule in rules:
        names = rule.get("resourceNames") or ["*"]
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    for name in names:
                        grants.add((group, resource, verb, name))
    return grants


def test_helm_binary_is_the_project_build() -> None:
    """The binary the chart tests use runs and is helm v3."""
    proc = run_helm("version", "--short")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("v3."), proc.stdout
