"""A worker logging JSON writes nothing but JSON lines, also what libraries print through their
own handlers (transformers' "[transformers] ..." lines, print, warnings)."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

from omnistage_worker.jsonlog import JsonFormatter
from omnistage_worker.stray_output import JsonLineStream

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import logging, sys, warnings
from omnistage_worker.cli import setup_logging
setup_logging("INFO", "json")
setup_logging("INFO", "json")  # again: no JSON inside JSON
logging.getLogger("omnistage_worker.x").info("own line")
import transformers.utils.logging as tlog
tlog.get_logger("transformers.models.x").warning("library line")
print("printed\\nover two lines", end="")
print(" and its end")
warnings.warn("a warning")
sys.stderr.write("partial at exit")
"""


def test_a_json_worker_writes_only_json_lines() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    lines = (done.stdout + done.stderr).splitlines()
    objects = [json.loads(line) for line in lines]  # every line parses
    messages = {(o["logger"], o["message"]) for o in objects}
    assert ("omnistage_worker.x", "own line") in messages
    assert ("stderr", "[transformers] library line") in messages  # its own handler's line
    assert ("stdout", "printed") in messages
    assert ("stdout", "over two lines and its end") in messages
    assert any("a warning" in o["message"] for o in objects)
    assert ("stderr", "partial at exit") in messages


def test_lines_are_split_and_blank_ones_dropped() -> None:
    target = io.StringIO()
    stream = JsonLineStream(target, "stdout", logging.INFO, JsonFormatter({"stage": "s"}))
    stream.write("a\n\nb")
    assert [json.loads(x)["message"] for x in target.getvalue().splitlines()] == ["a"]
    stream.write("c\r\n")
    stream.close_line()
    got = [json.loads(x) for x in target.getvalue().splitlines()]
    assert [o["message"] for o in got] == ["a", "bc"]
    assert {o["stage"] for o in got} == {"s"} and {o["level"] for o in got} == {"INFO"}
