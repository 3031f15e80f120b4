"""A good OmniStage manifest and the means to change it, apply it with ``kubectl`` and read it
back: the CRD tests' common ground (the ``cluster`` fixture applies the CRD)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.controlplane import ControlPlane

ROOT = Path(__file__).resolve().parents[2]


CRD = ROOT / "crds" / "omnistages.omnistage.io.yaml"


def good(name: str = "stage") -> dict[str, Any]:
    return {
        "apiVersion": "omnistage.io/v1alpha1",
        "kind": "OmniStage",
        "metadata": {"name": name},
        "spec": {
            "runner": "AR",
            "backend": "Transformers",
            "image": "omnistage/omnistage-worker:0.1.0",
            "model": {"path": "/models/tiny-llama"},
            "colocation": {"group": "g1"},
        },
    }


@pytest.fixture
def cluster(control_plane: ControlPlane) -> ControlPlane:
    """The control plane with the CRD applied and established."""
    control_plane.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD))
    control_plane.wait_crd_established("omnistages.omnistage.io")
    return control_plane


def apply(
    cp: ControlPlane, namespace: str, manifest: dict[str, Any], check: bool = True
) -> subprocess.CompletedProcess[str]:
    return cp.kubectl(
        "apply", "--validate=strict", "-n", namespace, "-f", "-", input=json.dumps(manifest),
        check=check,
    )  # fmt: skip


def get(cp: ControlPlane, namespace: str, name: str) -> dict[str, Any]:
    out = cp.kubectl("get", "omnistage", name, "-n", namespace, "-o", "json").stdout
    data: dict[str, Any] = json.loads(out)
    return data


Mutation = Callable[[dict[str, Any]], None]


def _set(path: str, value: Any) -> Mutation:
    def mutate(m: dict[str, Any]) -> None:
        node = m
        *parents, last = path.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value

    return mutate


def _drop(path: str) -> Mutation:
    def mutate(m: dict[str, Any]) -> None:
        node = m
        *parents, last = path.split(".")
        for p in parents:
            node = node[p]
        del node[last]

    return mutate


def _vllm(block: dict[str, Any]) -> Mutation:
    def mutate(m: dict[str, Any]) -> None:
        m["spec"]["backend"] = "VLLM"
        m["spec"]["vllm"] = block

    return mutate
