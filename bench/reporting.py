"""Output shared by the benchmarks: the report as indented JSON on stdout and, if asked, a file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def emit(report: dict[str, Any], out: Path | None) -> None:
    """Print ``report`` and write it to ``out`` (parents created) when given."""
    text = json.dumps(report, indent=2)
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
