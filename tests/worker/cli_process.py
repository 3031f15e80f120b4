"""The ``omnistage-worker`` command as a real process: a one-shot run, and a running worker whose
output goes to a log file (with a fixture that stops those a test started)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

WORKER = [sys.executable, "-m", "omnistage_worker"]
SUBPROCESS_ENV = {**os.environ, "OMNISTAGE_CPU_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*WORKER, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env or SUBPROCESS_ENV,
        check=False,
    )


class Subprocess:
    """A real ``omnistage-worker`` process whose stderr goes to a file."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.log = log
        self._log_file = log.open("w")
        self.proc = subprocess.Popen(
            [*WORKER, *args],
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env={**SUBPROCESS_ENV, **(env or {})},
        )

    def port(self, within: float = 60.0) -> int:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            match = re.search(r"listening on [\d.]+:(\d+)", self.log.read_text())
            if match:
                return int(match.group(1))
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"worker did not start listening:\n{self.log.read_text()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log_file.close()


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[list[Subprocess]]:
    started: list[Subprocess] = []
    yield started
    for proc in started:
        proc.stop()
