"""README.md quotes the committed benchmark results exactly (bench/report.py renders them)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.report import BEGIN, END, README, ROOT, components_section, render


def test_readme_benchmark_section_matches_results() -> None:
    readme = README.read_text()
    start, end = readme.index(BEGIN), readme.index(END) + len(END)
    assert readme[start:end] == render(), "run `python bench/report.py --write` and commit"


def test_components_section_renders_a_smoke_run(tmp_path: Path) -> None:
    """``bench/diffusion_components.py --smoke`` runs on CPU and its JSON renders as tables."""
    out = tmp_path / "components.json"
    subprocess.run(
        [sys.executable, "bench/diffusion_components.py", "--smoke", "--cycles", "1",
         "--requests", "1", "--steps", "2", "--out", str(out)],
        cwd=ROOT, check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    data = json.loads(out.read_text())
    assert data["summary"]["all_bit_identical"]
    assert (
        data["summary"]["sequential_peak_weights_gib"] == data["summary"]["largest_component_gib"]
    )
    lines = components_section(data)
    assert any(line.startswith("| text_encoder+text_encoder_2 |") for line in lines)
    assert any(line.startswith("| sequential (largest component") for line in lines)
