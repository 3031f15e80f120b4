"""Output shared by the benchmarks: the report as indented JSON on stdout and, if asked, a file."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any


def emit(report: dict[str, Any], out: Path | None) -> None:
    """Print ``report`` and write it to ``out`` (parents created) when given."""
    text = json.dumps(report, indent=2)
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")


def code_version(root: Path) -> str | None:
    """The tree's commit: a ``COMMIT`` file (a copy made for the GPU host), else git's."""
    marker = root / "COMMIT"
    if marker.exists():
        return marker.read_text().strip()
    found = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, check=False
    )
    return found.stdout.strip() or None
