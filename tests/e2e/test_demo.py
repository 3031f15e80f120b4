"""`make demo` works: the README's first command, run as it is (its own control plane)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_local_demo_runs_and_every_wake_follows_or_overlaps_the_sleep() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "local_demo.py")],
        capture_output=True,
        text=True,
        timeout=850,
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    orders = [line for line in out.splitlines() if line.startswith("order: ")]
    assert len(orders) == 3, out[-4000:]
    # Every wake after its sleep's ACK, or beside the sleep it replaced (the default, where
    # both workers can: these tiny stages can).
    assert all(
        (" before " in line and "NOT before" not in line) or " beside " in line for line in orders
    ), orders
    assert any(" beside " in line for line in orders), orders
    assert "tiny-diffusion   Waiting" in out  # the pre-emption left the lower priority waiting
    assert "held request served after a wake" in out  # OnDemand: traffic woke tiny-llama
    assert "awakeReason=Demand" in out
