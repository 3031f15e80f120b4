"""The examples cover each kind of stage, their cross references hold, and the chart values
under examples/helm/ render. The API server's verdict on each object: tests/e2e/test_examples.py
and tests/e2e/test_crd_validation.py; the Quick start as written: tests/e2e/test_quickstart.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from omnistage_operator.api.model_source import S3Source
from omnistage_operator.api.spec import Backend, Runner
from omnistage_operator.api.spec_parse import parse_stage
from omnistage_operator.k8s.builders import service_name
from tests.examples import HELM_VALUES, manifest_docs, stage_docs
from tests.unit.test_chart_support import render, select


def test_one_example_per_kind_of_stage() -> None:
    stages = [parse_stage(doc) for _, doc in stage_docs()]
    kinds = {
        "torch AR": any(s.backend is Backend.TRANSFORMERS for s in stages),
        "vLLM with tensor parallelism": any(
            s.backend is Backend.VLLM and s.gpus > 1 for s in stages
        ),
        "diffusion with components asleep": any(
            s.runner is Runner.DIFFUSION and s.asleep_components for s in stages
        ),
        "OnDemand": any(s.activation.on_demand for s in stages),
        "worker TLS": any(s.worker.tls.enabled for s in stages),
        "shared /dev/shm": any(s.template.extras.shm_size for s in stages),
        "model from an object store": any(isinstance(s.model.source, S3Source) for s in stages),
    }
    assert [k for k, found in kinds.items() if not found] == []


def test_stage_names_are_unique_across_examples() -> None:
    """The e2e tests apply every example into one namespace."""
    names = [doc["metadata"]["name"] for _, doc in stage_docs()]
    assert len(names) == len(set(names)), names


def test_tls_stages_have_a_certificate_naming_their_service() -> None:
    docs = manifest_docs()
    for path, doc in stage_docs():
        stage = parse_stage({**doc, "metadata": {**doc["metadata"], "namespace": "default"}})
        if not stage.worker.tls.enabled:
            continue
        certificates = [
            d for p, d in docs
            if p == path and d["kind"] == "Certificate"
            and d["spec"]["secretName"] == stage.worker.tls.secret_name
        ]  # fmt: skip
        assert len(certificates) == 1, f"{path}: no Certificate for {stage.name}"
        (cert,) = certificates
        assert cert["spec"]["dnsNames"] == [f"{service_name(stage.name)}.default.svc"]
        assert "server auth" in cert["spec"]["usages"]


def test_stages_mount_the_example_pvc() -> None:
    claims = {
        d["metadata"]["name"] for _, d in manifest_docs() if d["kind"] == "PersistentVolumeClaim"
    }
    used = {
        (doc["spec"]["model"].get("volume") or {}).get("persistentVolumeClaim", {}).get("claimName")
        for _, doc in stage_docs()
    } - {None}
    assert used and used <= claims, used - claims


@pytest.mark.parametrize("values_file", HELM_VALUES, ids=lambda p: Path(p).name)
def test_chart_values_examples_render(values_file: Path) -> None:
    values = yaml.safe_load(values_file.read_text())
    objs = render(values)
    groups = [g["name"] for g in values.get("router", {}).get("groups", [])]
    deployments = {o["metadata"]["name"] for o in select(objs, "Deployment")}
    for group in groups:
        assert any(name.endswith(f"router-{group}") for name in deployments), deployments
