"""bench/overlap.py in its CPU mode: two real worker processes handed over serially and
overlapped (SleepStream relayed into a WakeUp's claim limit), every Ack ok, tokens identical."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_run_hands_over_both_ways_in_both_modes(tmp_path: Path) -> None:
    out = tmp_path / "overlap.json"
    subprocess.run(
        [sys.executable, str(ROOT / "bench" / "overlap.py"), "--smoke", "--work",
         str(tmp_path / "w"), "--out", str(out), "--serial", "2", "--handovers", "3"],
        check=True, capture_output=True, timeout=480,
    )  # fmt: skip
    report = json.loads(out.read_text())
    summary = report["summary"]
    assert summary["all_acks_ok"] and summary["all_tokens_identical"]
    assert (summary["serial_count"], summary["overlapped_count"]) == (2, 3)
    runs = report["handovers"]
    assert [r["to"] for r in runs] == ["b", "a", "b", "a", "b"]
    for run in runs[2:]:
        # the limit started at what the incoming worker held plus the free memory, and the
        # sleep's Ack raised it at least once before the wake could end
        assert run["mode"] == "overlapped" and run["limit_raises"] >= 1
        assert run["wake"]["used_after_bytes"] > 0 and run["sleep"]["freed_bytes"] > 0
