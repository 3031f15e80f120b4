"""Imports point down the layers (issue 25), typing-only and function-level imports included.

The operator: ``api`` < ``decisions`` < ``k8s`` < ``runtime`` < ``cli``. The worker: its basics
(config, quantities, log lines, the model's init step) < ``memory`` < ``engine`` < ``runners`` <
``control`` < the worker itself (``state``, ``metrics``) < ``serving`` < ``cli``. A module may
import its own layer and the layers below it; ``KNOWN_UPWARD`` names the imports still pointing
up, each with why, so that a new one fails here.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.import_graph import import_graph

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [ROOT / "operator" / "src", ROOT / "worker_image" / "src"]

OPERATOR = ["api", "decisions", "k8s", "runtime", "cli"]
WORKER = [
    {
        "config", "limits", "quantities", "dtype_choices", "jsonlog", "stray_output",
        "host_allocator", "fetch", "fetch_s3", "sigv4", "flag_groups", "token_review_settings",
    },
    {"memory"},
    {"engine"},
    {"runners"},
    {"control"},
    {"state", "metrics"},
    {"serving"},
    {"cli", "__main__"},
]  # fmt: skip

KNOWN_UPWARD: dict[tuple[str, str], str] = {}  # (module, imported): why; none left


def layer_of(module: str) -> tuple[str, int] | None:
    """The package and the layer rank of one of the project's modules."""
    top, _, rest = module.partition(".")
    first = rest.split(".", 1)[0]
    if top == "omnistage_operator":
        return (top, OPERATOR.index(first)) if first in OPERATOR else None
    if top == "omnistage_worker":
        for rank, names in enumerate(WORKER):
            if first in names:
                return top, rank
    return None


def upward_imports() -> dict[tuple[str, str], str]:
    found: dict[tuple[str, str], str] = {}
    for module, edges in import_graph(SOURCES).items():
        for edge in edges:
            src, dst = layer_of(edge.source), layer_of(edge.target)
            if src and dst and src[0] == dst[0] and dst[1] > src[1]:
                found[(edge.source, edge.target)] = f"{module} -[{edge.kind} @{edge.line}]->"
    return found


def test_every_module_has_a_layer() -> None:
    graph = import_graph(SOURCES)
    assert len(graph) > 100, "the source roots moved: the graph would be empty"
    missing = sorted(m for m in graph if "." in m and layer_of(m) is None)
    assert not missing, f"modules outside every layer (name them in OPERATOR or WORKER): {missing}"


def test_imports_point_down_the_layers() -> None:
    found = upward_imports()
    new = {k: v for k, v in found.items() if k not in KNOWN_UPWARD}
    if new:
        pytest.fail(
            "imports pointing up a layer:\n" + "\n".join(f"{v} {k[1]}" for k, v in new.items()),
            pytrace=False,
        )
    gone = sorted(set(KNOWN_UPWARD) - set(found))
    assert not gone, f"no longer upward: drop from KNOWN_UPWARD: {gone}"


def test_a_layer_check_sees_an_upward_import() -> None:
    assert layer_of("omnistage_operator.api.spec") == ("omnistage_operator", 0)
    assert layer_of("omnistage_operator.runtime.runner") == ("omnistage_operator", 3)
    assert layer_of("omnistage_worker.serving.server") == ("omnistage_worker", 6)
    assert layer_of("omnistage_worker.engine.weights") == ("omnistage_worker", 2)
