"""The openai-client conformance suite against a real vLLM stage, on the lent GPU host.

Builds the random-weight Llama and byte-level tokenizer of ``bench/serving_vllm.py``
(``bench/vllm_servers.py``'s ``build_model``, reused under ``--workdir``), starts a vLLM
stage the way that bench does (the omnistage worker of this tree: vLLM's OpenAI app over its
``AsyncLLM`` behind the worker's gate, the same engine flags), waits for its ``/health`` to
say Active, then runs ``tests/worker/test_openai_conformance.py -k vllm`` with
``OMNISTAGE_CONFORMANCE_VLLM`` and ``OMNISTAGE_CONFORMANCE_VLLM_MODEL`` naming it. Into
``--out``: the pytest report (``-rA``, ``vllm_conformance.txt``), its JUnit XML, the stage's
log and a JSON summary (machine, vLLM version, engine flags, every test's outcome).

pytest runs without the tests' conftest files (``--noconftest``: the vLLM target needs none of
their fixtures, and the cluster plugin's imports are not on the host) and without plugin
autoload (``pytest_asyncio`` and ``pytest_timeout`` named), with ``--pytest-path`` first on its
``PYTHONPATH``: the host lacks pytest-asyncio and the pinned ``openai`` client, carried as
wheels (bench/results/README.md). ``--smoke`` runs the same code on CPU with the stand-in
engine (tests/fakevllm) on a simulated GPU: it checks the harness, not vLLM.

    python3 bench/vllm_conformance.py --workdir /tmp/vllmserve --pytest-path /tmp/ctest
    python bench/vllm_conformance.py --smoke --workdir /tmp/vllmconf-smoke --out /tmp/vc
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "worker_image/src"), str(REPO / "protos/gen/python"), str(REPO)]

from bench.vllm_servers import (  # noqa: E402
    add_engine_arguments,
    build_model,
    env_for,
    machine,
    start_stage,
    wait_http,
    worker_config,
)

Json = dict[str, Any]
SUITE = [
    "tests/worker/test_openai_conformance.py",
    "tests/worker/test_openai_conformance_refusals.py",
]
"""The suite's files with a vLLM target (the image tests have none)."""
SERVED = "llm"  # the served model name serving_vllm's worker flags give the stage
NAME = "vllm_conformance"


def pytest_argv(out: Path) -> list[str]:
    """pytest on the suite's vLLM target: the report to stdout and JUnit XML under ``out``."""
    return [
        sys.executable, "-m", "pytest", *SUITE, "-k", "vllm", "-rA", "-v",
        "-p", "no:cacheprovider", "--noconftest",
        "-p", "pytest_asyncio.plugin", "-p", "pytest_timeout",
        f"--junitxml={out / f'{NAME}.xml'}",
    ]  # fmt: skip


def pytest_env(url: str, pytest_path: list[str]) -> dict[str, str]:
    paths = [*pytest_path, str(REPO), str(REPO / "worker_image/src"),
             str(REPO / "protos/gen/python"), str(REPO / "operator/src")]  # fmt: skip
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")])
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    env["OMNISTAGE_CONFORMANCE_VLLM"] = url
    env["OMNISTAGE_CONFORMANCE_VLLM_MODEL"] = SERVED
    return env


def outcomes(junit: Path) -> Json:
    """Every test case's outcome (with its failure's message) and the counts, from JUnit XML."""
    cases: list[Json] = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        entry: Json = {"test": case.get("name"), "outcome": "passed",
                       "seconds": round(float(case.get("time") or 0), 2)}  # fmt: skip
        for kind, outcome in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            found = case.find(kind)
            if found is not None:
                entry |= {"outcome": outcome, "message": (found.get("message") or "")[:2000]}
                break
        cases.append(entry)
    kinds = ("passed", "failed", "error", "skipped")
    return {"counts": {k: sum(c["outcome"] == k for c in cases) for k in kinds}, "tests": cases}


def run_pytest(argv: list[str], env: dict[str, str], report_path: Path, timeout: float) -> int:
    with report_path.open("wb") as text:
        done = subprocess.run(
            argv, cwd=REPO, env=env, stdout=text, stderr=subprocess.STDOUT, timeout=timeout,
            check=False,
        )  # fmt: skip
    return done.returncode


async def run(a: argparse.Namespace) -> Json:
    out: Path = a.out
    report: Json = {"command": " ".join(sys.argv), "smoke": a.smoke, "machine": machine(a.smoke)}
    started = time.monotonic()
    report["model"] = build_model(a.workdir, a.smoke)
    report["model_build_s"] = round(time.monotonic() - started, 1)
    model = Path(report["model"]["dir"])
    fake_dir: Path | None = None
    if a.smoke:
        from tests.fakegpu.device import FakeGpu
        from tests.fakegpu.model import Device

        fake_dir = a.workdir / "fakegpu"
        if not fake_dir.exists():
            FakeGpu.create(fake_dir, Device(uuid="GPU-smoke", total=400_000_000))
    from omnistage_worker.runners.vllm_serve import serve_argv

    report["engine_flags"] = serve_argv(worker_config(a, model), a.utilization, tokenizer=True)
    log = a.workdir / "stage.log"
    stage = start_stage(a, model, env_for(a.smoke, fake_dir), log, "manual")
    try:
        await wait_http(stage, "/health", a.start_timeout)
        report["stage_ready_s"] = round(stage.ready_s, 1)
        url = f"http://127.0.0.1:{stage.port}"
        argv = pytest_argv(out)
        report["pytest"] = " ".join(argv[1:])
        began = time.monotonic()
        env = pytest_env(url, a.pytest_path)
        report["pytest_rc"] = await asyncio.to_thread(
            run_pytest, argv, env, out / f"{NAME}.txt", a.pytest_timeout
        )
        report["pytest_s"] = round(time.monotonic() - began, 1)
    finally:
        stage.stop()
        tail = log.read_bytes()[-200_000:] if log.exists() else b""
        (out / f"{NAME}_stage.log").write_bytes(tail)
    junit = out / f"{NAME}.xml"
    if junit.exists():
        report |= outcomes(junit)
    counts = report.get("counts", {})
    report["all_passed"] = (
        report.get("pytest_rc") == 0
        and counts.get("passed", 0) > 0
        and counts["passed"] == len(report["tests"])
    )
    (out / f"{NAME}.json").write_text(json.dumps(report, indent=1))
    return report


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", type=Path, default=Path("/tmp/vllmserve"))
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/vllmconf-out")))
    p.add_argument("--smoke", action="store_true", help="CPU, tiny, stand-in engine")
    p.add_argument("--pytest-path", action="append", default=[],
                   help="first on pytest's PYTHONPATH (pytest-asyncio, openai)")  # fmt: skip
    add_engine_arguments(p)
    p.add_argument("--pytest-timeout", type=float, default=900)
    a = p.parse_args()
    if a.smoke:
        a.attention_backend = None
    a.workdir.mkdir(parents=True, exist_ok=True)
    a.out.mkdir(parents=True, exist_ok=True)
    report = asyncio.run(run(a))
    print(json.dumps({k: report.get(k) for k in ("counts", "all_passed", "pytest_rc")}))
    return 0 if report["all_passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
