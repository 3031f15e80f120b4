"""The conformance suite's vLLM target exists only when a stage is named, and
bench/vllm_conformance.py reads pytest's JUnit XML into its summary."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.vllm_conformance import SUITE, outcomes, pytest_argv, pytest_env

ROOT = Path(__file__).resolve().parents[2]


def collected(env: dict[str, str]) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *SUITE],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    return [line for line in done.stdout.splitlines() if "::" in line]


def test_the_vllm_target_is_collected_only_when_a_stage_is_named() -> None:
    bare = {k: v for k, v in os.environ.items() if not k.startswith("OMNISTAGE_CONFORMANCE")}
    without = collected(bare)
    assert without and not [t for t in without if "vllm" in t]
    named_env = pytest_env("http://127.0.0.1:1", [])
    del named_env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"]  # the suite's own conftest and plugins
    named = collected(named_env)
    vllm = [t for t in named if "[vllm" in t]
    assert "tests/worker/test_openai_conformance.py::test_logprobs[vllm]" in vllm
    assert len(vllm) == len([t for t in named if "[torch" in t and "test_images" not in t])


def test_junit_outcomes_are_counted_with_their_messages(tmp_path: Path) -> None:
    tests = tmp_path / "test_some.py"
    tests.write_text(
        "import pytest\n"
        "def test_ok(): pass\n"
        "def test_bad(): assert 1 == 2, 'one is not two'\n"
        "@pytest.mark.skip(reason='not here')\n"
        "def test_skipped(): pass\n"
    )
    junit = tmp_path / "out.xml"
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests),
         f"--junitxml={junit}", "--rootdir", str(tmp_path)],
        cwd=tmp_path, capture_output=True, timeout=120, check=False,
    )  # fmt: skip
    found = outcomes(junit)
    assert found["counts"] == {"passed": 1, "failed": 1, "error": 0, "skipped": 1}
    bad = next(t for t in found["tests"] if t["test"] == "test_bad")
    assert bad["outcome"] == "failed" and "one is not two" in bad["message"]


def test_pytest_runs_the_vllm_target_alone_without_conftest_or_autoloaded_plugins(
    tmp_path: Path,
) -> None:
    argv = pytest_argv(tmp_path)
    assert argv[argv.index("-k") + 1] == "vllm" and "--noconftest" in argv
    assert f"--junitxml={tmp_path / 'vllm_conformance.xml'}" in argv
    env = pytest_env("http://127.0.0.1:9", ["/tmp/site"])
    assert env["PYTHONPATH"].startswith("/tmp/site" + os.pathsep)
    assert env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] == "1"
    assert env["OMNISTAGE_CONFORMANCE_VLLM"] == "http://127.0.0.1:9"


@pytest.fixture(autouse=True)
def _no_stage_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMNISTAGE_CONFORMANCE_VLLM", raising=False)
