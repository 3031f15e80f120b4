"""``bench/serving.py --smoke`` runs its whole code on CPU with tiny models, and its JSON
renders as the README's serving section (a smoke run itself is not rendered)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.report import ROOT
from bench.report_serving import serving_section


def test_serving_smoke_runs_and_renders(tmp_path: Path) -> None:
    out = tmp_path / "serving.json"
    subprocess.run(
        [sys.executable, "bench/serving.py", "--smoke", "--work", str(tmp_path / "work"),
         "--out", str(out)],
        cwd=ROOT, check=True, timeout=600, capture_output=True,
    )  # fmt: skip
    data = json.loads(out.read_text())
    summary = data["summary"]
    assert summary["all_http_answered"] and summary["swaps_nothing_lost"]
    assert summary["swaps_all_acks_ok"] and summary["swaps"] >= 2
    assert set(summary["torch_tokens_per_s"]) == {"1", "4", "8"}
    assert all(rate > 0 for rate in summary["torch_tokens_per_s"].values())
    assert summary["torch_16_clients_of_batched"] > 0
    assert set(summary["images_per_s"]) == {"1", "4"}
    in_process = data["llm"]["batcher_in_process"]
    assert in_process["one"] > 0 and in_process["together_4"] > 0
    assert serving_section(data) == []  # smoke runs stay out of the README
    lines = serving_section({**data, "smoke": False})
    text = "\n".join(lines)
    assert "16 clients of batched" in text and "nothing lost: yes" in text
    assert "images/s" in text
