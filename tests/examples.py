"""The manifests and chart values under examples/, for the tests that check them.

``MANIFESTS``: every ``*.yaml`` but ``examples/helm/`` (chart values files, ``helm -f``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES_DIR = ROOT / "examples"
HELM_VALUES = sorted((EXAMPLES_DIR / "helm").glob("*.yaml"))
MANIFESTS = sorted(p for p in EXAMPLES_DIR.rglob("*.yaml") if p not in HELM_VALUES)


def manifest_docs() -> list[tuple[Path, dict[str, Any]]]:
    """Every object of every example manifest, with its file."""
    return [
        (path, doc) for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if doc
    ]


def stage_docs() -> list[tuple[Path, dict[str, Any]]]:
    """The OmniStages of the examples, with their files."""
    return [(p, d) for p, d in manifest_docs() if d.get("kind") == "OmniStage"]
