"""The CRD travels with the release: ``helm upgrade`` applies a new schema, uninstall keeps it.

On the real local control plane: install the previous chart layout (0.1.0, the CRD in the
chart's ``crds/`` folder, which helm installs once and never upgrades), create a stage, upgrade
to the templated chart with a CRD that gains a field (adopting the CRD with
``--take-ownership``, as CHANGELOG.md's "Upgrading" says), and show that the API server
serves the new field while the existing stage survives; upgrade again (no flag needed) and
uninstall: the CRD and the stages stay.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.cluster.controlplane import ControlPlane
from tests.cluster.procs import wait_for
from tests.e2e.test_helm_support import (
    CRD_NAME,
    CRD_SOURCE,
    CRD_TEMPLATE,
    apply_crd,
    describe_release,
    install_chart,
    stage_manifest,
    uninstall_chart,
    upgrade_chart,
)
from tests.unit.test_chart_support import CHART_DIR

pytestmark = pytest.mark.cluster

NEW_FIELD = "upgradeProbe"
# The sibling the new field is inserted before, at spec.versions[0].schema...spec.properties.
ANCHOR = "                template:\n                  description: Overrides merged"


def previous_chart(into: Path) -> Path:
    """The chart as 0.1.0 shipped it: the CRD source in ``crds/``, no CRD template."""
    chart = into / "previous" / "omnistage-operator"
    shutil.copytree(CHART_DIR, chart)
    shutil.rmtree(chart / "templates" / "crds")
    (chart / "crds").mkdir()
    shutil.copy(CRD_SOURCE, chart / "crds" / CRD_SOURCE.name)
    return chart


def next_chart(into: Path) -> Path:
    """The chart with a CRD that gains ``spec.upgradeProbe`` (a string), version 0.2.0."""
    chart = into / "next" / "omnistage-operator"
    shutil.copytree(CHART_DIR, chart)
    template = chart / "templates" / "crds" / CRD_TEMPLATE.name
    text = template.read_text()
    assert text.count(ANCHOR) == 1, "the CRD changed shape: update ANCHOR"
    field = f"                {NEW_FIELD}:\n                  type: string\n"
    template.write_text(text.replace(ANCHOR, field + ANCHOR))
    meta = yaml.safe_load((chart / "Chart.yaml").read_text())
    meta["version"] = "0.2.0"
    (chart / "Chart.yaml").write_text(yaml.safe_dump(meta))
    return chart


def create(cp: ControlPlane, manifest: str) -> subprocess.CompletedProcess[str]:
    """``kubectl create`` with strict server-side field validation (kubectl's default)."""
    return cp.kubectl("create", "--validate=strict", "-f", "-", input=manifest, check=False)


def test_upgrade_applies_the_new_crd_and_keeps_stages(
    control_plane: ControlPlane, tmp_path: Path
) -> None:
    cp = control_plane
    stages = cp.create_namespace("upgrade")
    apply_crd(cp)  # the CRD as a 0.1.0 install left it (or shared with earlier tests)
    release = install_chart(cp, {"crds": {"enabled": True}}, chart=previous_chart(tmp_path))
    try:
        assert create(cp, stage_manifest("before", stages, "upgrade")).returncode == 0
        before_spec = cp.get_json("omnistage", "before", namespace=stages)["spec"]
        refused = create(cp, stage_manifest("early", stages, "upgrade", **{NEW_FIELD: "x"}))
        assert refused.returncode != 0 and f'unknown field "spec.{NEW_FIELD}"' in refused.stderr

        # Without adoption helm refuses: the CRD belongs to no release.
        upgraded = next_chart(tmp_path)
        plain = cp.helm(
            "upgrade", release.name, str(upgraded), "-n", release.namespace,
            "--reuse-values", "--set", "crds.enabled=true,crds.keep=true", check=False,
        )  # fmt: skip
        assert plain.returncode != 0 and "exists and cannot be imported" in plain.stderr
        # CHANGELOG.md's command, as written.
        cp.helm(
            "upgrade", release.name, str(upgraded), "-n", release.namespace,
            "--reuse-values", "--set", "crds.enabled=true,crds.keep=true", "--take-ownership",
        )  # fmt: skip
        crd = cp.get_json("crd", CRD_NAME)
        assert crd["metadata"]["annotations"]["meta.helm.sh/release-name"] == release.name
        assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
        cp.wait_crd_established(CRD_NAME)

        def served() -> bool:
            proc = create(cp, stage_manifest("after", stages, "upgrade", **{NEW_FIELD: "served"}))
            return proc.returncode == 0

        wait_for(f"the API server to serve spec.{NEW_FIELD}", served, 60, interval=0.5)
        after = cp.get_json("omnistage", "after", namespace=stages)
        assert after["spec"][NEW_FIELD] == "served"  # stored, not pruned
        assert cp.get_json("omnistage", "before", namespace=stages)["spec"] == before_spec

        # A later upgrade (back to this tree's chart) needs no flag and applies its schema.
        upgrade_chart(cp, describe_release(cp, release.name, release.namespace), {"crds": {}})
        wait_for(
            f"spec.{NEW_FIELD} to leave the schema",
            lambda: NEW_FIELD not in json.dumps(cp.get_json("crd", CRD_NAME)["spec"]),
            60,
            interval=0.5,
        )
        uninstall_chart(cp, release)
        crd = cp.get_json("crd", CRD_NAME)  # kept (helm.sh/resource-policy: keep)
        assert crd["metadata"].get("deletionTimestamp") is None
        names = {
            o["metadata"]["name"] for o in cp.get_json("omnistages", namespace=stages)["items"]
        }
        assert names == {"before", "after"}
    finally:
        cp.helm("uninstall", release.name, "-n", release.namespace, check=False)
        cp.kubectl("delete", "omnistages", "--all", "-n", stages, "--wait=false", check=False)
        cp.kubectl("delete", "secret", release.token_secret, "-n", release.namespace, check=False)
        apply_crd(cp)
        cp.delete_namespace(stages)
        cp.delete_namespace(release.namespace)
