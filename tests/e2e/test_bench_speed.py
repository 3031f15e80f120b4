"""bench/speed.py in its CPU mode: every summary key there, the operator's figure measured on
the local control plane in this run, the GPU keys None with the reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench import speed_figures

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_mode_measures_the_operator_and_says_why_the_rest_is_missing(tmp_path: Path) -> None:
    out = tmp_path / "speed.json"
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
    subprocess.run(
        [sys.executable, str(ROOT / "bench" / "speed.py"), "--work", str(tmp_path / "w"),
         "--out", str(out), "--switches", "2"],
        check=True, capture_output=True, timeout=480, env=env,
    )  # fmt: skip
    report = json.loads(out.read_text())
    summary = report["summary"]
    assert set(speed_figures.GOALS) <= set(summary)
    assert report["asked"] == ["operator"]
    # the operator's share: the p50 of this run's own hand-overs, each measured by a watch
    ran = report["parts"]["operator"]
    assert ran["exit"] == 0 and "reused" not in ran
    part = json.loads((tmp_path / "w" / "parts" / "operator.json").read_text())
    overheads = sorted(r["overhead"] for r in part["runs_ms"])
    assert len(overheads) == 2 and all(0 < ms < 30_000 for ms in overheads)
    assert abs(summary["operator_p50_ms"] - sum(overheads) / 2) <= 0.1
    assert summary["source"] == {"operator_p50_ms": "operator"}
    for key in set(speed_figures.GOALS) - {"operator_p50_ms"}:
        assert summary[key] is None and summary["missing"][key], key
    assert "GPU" in summary["missing"]["cold_start_first_token_s"]
    beside = tmp_path / "speed_parts"  # what comes back from a device call with the summary
    assert json.loads((beside / "operator.json").read_text()) == part
    assert (beside / "operator.log").is_file()
