"""What an install of an extra brings, walked through the installed packages' own metadata.

httpcore (under kr8s's and the worker's httpx clients) asks ``sniffio`` which async library
runs, several times per request. Nothing the operator extra needs requires sniffio (anyio 4
dropped it), so the operator's image had none, and each ask was a failed import searching every
``sys.path`` entry: about 260 us more client CPU per API request (``bench/http_pool_cpu.py`` with
sniffio hidden), 11% of the operator's samples in a 1000-stage hand-over storm
(``bench/results/scale_1000_opcores_pyspy.txt``).
"""

from __future__ import annotations

import tomllib
from importlib.metadata import PackageNotFoundError, requires
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]


def extra_closure(extra: str) -> set[str]:
    """Every distribution ``pip install .[extra]`` installs, by canonical name (this
    repository's own requirements from pyproject.toml, the rest from the installed metadata)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    todo = [Requirement(r) for r in project["dependencies"]]
    todo += [Requirement(r) for r in project["optional-dependencies"][extra]]
    seen: set[str] = set()
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in seen or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        try:
            found = requires(name) or []
        except PackageNotFoundError:
            continue
        todo += [Requirement(r) for r in found]
    return seen


@pytest.mark.parametrize("extra", ["operator", "worker"])
def test_an_install_with_httpx_brings_sniffio(extra: str) -> None:
    closure = extra_closure(extra)
    assert "httpx" in closure
    assert "sniffio" in closure, f"the {extra} extra installs httpx but not sniffio"


def test_the_closure_follows_installed_requirements() -> None:
    # kr8s -> httpx -> httpcore -> h11: a walk that stopped at the first level would miss h11
    assert {"kr8s", "httpx", "httpcore", "h11"} <= extra_closure("operator")
