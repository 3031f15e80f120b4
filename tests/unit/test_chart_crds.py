"""The chart's CRD is a template: installed and upgraded with the release, kept on uninstall.

The template is generated from the one source (crds/omnistages.omnistage.io.yaml) by
``make generate`` (crds/chart-template.sh); the upgrade itself runs on the real API server in
tests/e2e/test_helm_crds.py.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e.test_helm_support import (
    CRD_NAME,
    CRD_SOURCE,
    CRD_TEMPLATE,
    check_chart_crd_copy,
    crd_template_text,
)
from tests.unit.test_chart_support import CHART_DIR, Obj, render, render_error, select

KEEP = "helm.sh/resource-policy"


def _crds(values: dict[str, Any] | None = None) -> list[Obj]:
    """The rendered OmniStage CRD (OmniPipeline's: tests/unit/test_chart_pipelines.py)."""
    crds = select(render(values), "CustomResourceDefinition")
    return [c for c in crds if c["metadata"]["name"] == CRD_NAME]


def test_the_template_is_a_fresh_generation_of_the_source() -> None:
    check_chart_crd_copy()
    text = CRD_TEMPLATE.read_text()
    assert text.startswith("{{- /* Generated from crds/omnistages.omnistage.io.yaml")
    assert "{{- if .Values.crds.enabled }}" in text


def test_the_chart_has_no_crds_folder() -> None:
    """helm installs crds/ once and never upgrades it; a copy there would also clash with the
    template on the first install."""
    assert not (CHART_DIR / "crds").exists()


def test_default_renders_the_source_crd_kept_on_uninstall() -> None:
    (crd,) = _crds()
    source = yaml.safe_load(CRD_SOURCE.read_text())
    assert crd["metadata"]["name"] == CRD_NAME
    assert crd["metadata"]["annotations"] == {KEEP: "keep"}
    assert crd["metadata"]["labels"] == {
        **source["metadata"]["labels"],
        "app.kubernetes.io/instance": "omnistage-operator",
        "app.kubernetes.io/managed-by": "Helm",
        "helm.sh/chart": "omnistage-operator-0.1.0",
    }
    assert crd["spec"] == source["spec"]


def test_keep_off_lets_uninstall_delete_it() -> None:
    (crd,) = _crds({"crds": {"keep": False}})
    assert KEEP not in (crd["metadata"].get("annotations") or {})
    assert crd["spec"] == yaml.safe_load(CRD_SOURCE.read_text())["spec"]


def test_disabled_renders_no_crd() -> None:
    assert _crds({"crds": {"enabled": False}}) == []


def test_generation_refuses_a_source_helm_would_read_as_a_template(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(CRD_SOURCE.read_text().replace("description:", "description: '{{ x }}'", 1))
    with pytest.raises(subprocess.CalledProcessError) as info:
        crd_template_text(bad)
    assert "template action" in info.value.stderr


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"crds": {"enabled": "yes"}}, "/crds/enabled"),
        ({"crds": {"keep": 1}}, "/crds/keep"),
        ({"crds": {"install": True}}, "install"),
    ],
)
def test_bad_crds_values_are_refused_naming_the_key(values: Obj, named: str) -> None:
    err = render_error(values)
    assert named in err, err
