"""The README's Quick start, run as written on a fresh local control plane.

The commands come from the README's first ``sh`` block under "Quick start on a real cluster":
helm installs the chart (with its CRD) into an empty cluster, the examples are applied and the
stages patched and described. A watch (``-w``) runs once without it. The cluster is this
test's own (the session's already holds the CRD, which a fresh ``helm install`` must create);
it runs no controller-manager, so the chart's operator pods are never created.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster.build import find_binaries
from tests.cluster.controlplane import ControlPlane
from tests.unit.test_chart_support import REPO_ROOT

pytestmark = pytest.mark.cluster

SECTION = "## Quick start on a real cluster"


def quickstart_commands(readme: str) -> list[str]:
    """The shell commands of the section's first ``sh`` block (continuations joined, comments
    and blank lines out)."""
    section = readme[readme.index(SECTION) :]
    block = re.search(r"```sh\n(.*?)```", section, re.S)
    assert block, f"no sh block under {SECTION!r}"
    text = block.group(1).replace("\\\n", " ")
    commands = []
    for line in text.splitlines():
        command = line.split(" #", 1)[0].strip()
        if command and not command.startswith("#"):
            commands.append(command)
    return commands


@pytest.fixture(scope="module")
def fresh_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    with ControlPlane(binaries=find_binaries(), controller_manager=False) as cp:
        yield cp


def test_quickstart_runs_as_written(fresh_cluster: ControlPlane, tmp_path: Path) -> None:
    cp = fresh_cluster
    commands = quickstart_commands((REPO_ROOT / "README.md").read_text())
    assert [c.split()[0] for c in commands] == ["helm", "kubectl", "kubectl", "kubectl",
                                                "kubectl", "kubectl"]  # fmt: skip
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("kubectl", "helm"):
        (bin_dir / tool).symlink_to(getattr(cp.binaries, tool))
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "KUBECONFIG": str(cp.kubeconfig),
        "HELM_CACHE_HOME": str(tmp_path / "helm" / "cache"),
        "HELM_CONFIG_HOME": str(tmp_path / "helm" / "config"),
        "HELM_DATA_HOME": str(tmp_path / "helm" / "data"),
    }
    for written in commands:
        command = re.sub(r"\s-w\b", "", written.replace("<registry>", "registry.example.com/you"))
        proc = subprocess.run(  # (a watch runs once)
            ["bash", "-euo", "pipefail", "-c", command],
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        assert proc.returncode == 0, f"{command!r} failed:\n{proc.stdout}\n{proc.stderr}"

    states = {
        name: cp.get_json("omnistage", name, namespace="default")["spec"]["state"]
        for name in ("writer", "painter")
    }
    assert states == {"writer": "Asleep", "painter": "Active"}
    crd = cp.get_json("crd", "omnistages.omnistage.io")
    assert crd["metadata"]["annotations"]["meta.helm.sh/release-name"] == "omnistage-operator"
    deployment = cp.get_json("deployment", "omnistage-operator", namespace="omnistage-system")
    image = deployment["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image == "registry.example.com/you/omnistage-operator:0.1.0"
