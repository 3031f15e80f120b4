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


def test_multi_gpu_section_renders_a_gpu_run_and_skips_a_smoke_run() -> None:
    from bench.report import multi_gpu_section

    assert multi_gpu_section({"smoke": True}) == []
    summary: dict[str, object] = {
        "handovers": 4,
        "all_acks_ok": True,
        "all_tokens_identical": True,
        "every_ack_lists_both_devices": True,
        "every_device_freed_on_sleep": True,
        "level2_wake_seconds": 0.5,
        "ack_vs_outside_nvml_max_diff_mib": 0.0,
        "b_wake_while_a_awake_refused": True,
    }
    for key in ("a_sleep", "a_wake", "b_sleep", "b_wake"):
        summary[f"{key}_seconds_median"] = 0.2
        summary[f"{key}_per_device_gbps_median"] = [40.0, 41.0]
    limits = {f"{d}_together_gbps_cuda{i}": 50.0 for d in ("h2d", "d2h") for i in (0, 1)}
    data = {
        "smoke": False,
        "date": "2026-11-23T01:00:00+00:00",
        "stage_gib": 16.0,
        "machine": {"gpus": ["NVIDIA H200", "NVIDIA H200"]},
        "limits": limits,
        "ballast": {"free_with_ballast_bytes": [4 << 30, 4 << 30], "both_fit": False},
        "summary": summary,
    }
    text = "\n".join(multi_gpu_section(data))
    assert "2 x NVIDIA H200" in text and "both fit: **no**" in text
    assert "| A sleep / wake (level 1) | 0.200 s (40.0, 41.0 GB/s per device)" in text


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
