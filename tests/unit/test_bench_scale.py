"""bench/scale_report.py: the percentiles, the README table and the plot of bench/scale.py."""

from __future__ import annotations

import json
from pathlib import Path

from bench.scale_report import markdown, percentiles, write_svg

ROOT = Path(__file__).resolve().parents[2]


def test_percentiles_interpolate_and_count() -> None:
    got = percentiles([float(v) for v in range(1, 101)])
    assert got == {"p50": 50.5, "p95": 95.05, "p99": 99.01, "max": 100.0, "n": 100}
    assert percentiles([]) == {}


def test_the_committed_results_render_a_row_per_storm_and_a_line_per_replica_count(
    tmp_path: Path,
) -> None:
    result = json.loads((ROOT / "bench" / "results" / "scale.json").read_text())
    table = markdown(result).splitlines()
    storms = sum(
        1
        for run in result["runs"]
        for name in ("ondemand", "handover", "handover_again", "leader_kill", "unresponsive")
        if name in run
    )
    assert len(table) == 2 + storms
    assert set(result["summary"]) >= {
        "stages", "nodes", "storm_overhead_p99_s", "storm_converge_s", "operator_rss_mib",
    }  # fmt: skip
    svg = tmp_path / "plot.svg"
    write_svg(result["runs"], svg)
    text = svg.read_text()
    replicas = {run["replicas"] for run in result["runs"]}
    assert text.count("<polyline") == 2 * len(replicas)  # p50 and p99 each
