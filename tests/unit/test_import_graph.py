"""No import circle among the project's modules, typing-only and function-level imports included.

A module typed against the object that owns it (``port_listing`` against ``GroupRunner``,
``transition_acks`` against ``Worker``) is a circle in the design even when the import sits
under ``TYPE_CHECKING``; such parts are typed against a protocol of a lower module instead
(``port_host``, ``worker_parts``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.import_graph import circles, describe, import_graph

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [ROOT / "operator" / "src", ROOT / "worker_image" / "src"]


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_the_project_has_no_import_circle() -> None:
    graph = import_graph(SOURCES)
    assert len(graph) > 100, "the source roots moved: the graph would be empty"
    found = circles(graph)
    if found:
        pytest.fail("import circles:\n" + "\n".join(describe(c) for c in found), pytrace=False)


def test_a_typing_only_circle_is_a_circle(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/owner.py": "from pkg.part import Part\n",
            "pkg/part.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n"
                "    from pkg.owner import Owner\n"
            ),
        },
    )
    (circle,) = circles(import_graph([root]))
    assert describe(circle) == "pkg.owner -[module @1]-> pkg.part -[typing @3]-> pkg.owner"


def test_imports_in_functions_and_relative_ones_are_edges(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/sub/__init__.py": "from . import leaf\n",
            "pkg/sub/leaf.py": "def f() -> None:\n    from ..top import g\n",
            "pkg/top.py": "import pkg.sub.leaf as leaf\ndef g() -> None: ...\n",
        },
    )
    graph = import_graph([root])
    assert [(e.target, e.kind) for e in graph["pkg.sub"]] == [("pkg.sub.leaf", "module")]
    assert [(e.target, e.kind) for e in graph["pkg.sub.leaf"]] == [("pkg.top", "function")]
    (circle,) = circles(graph)
    assert describe(circle) == ("pkg.sub.leaf -[function @2]-> pkg.top -[module @1]-> pkg.sub.leaf")


def test_a_tree_without_circles_passes(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"a.py": "import b\n", "b.py": "import c\n", "c.py": "import os\n"})
    graph = import_graph([root])
    assert circles(graph) == []
    assert [e.target for e in graph["a"]] == ["b"]
    assert graph["c"] == []
