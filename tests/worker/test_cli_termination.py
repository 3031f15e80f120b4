"""The worker's termination message: one line, written where the kubelet reads it, for a bad
flag, a model that is missing or fails to load, and a server that cannot start."""

from __future__ import annotations

from pathlib import Path

from omnistage.worker.v1 import types_pb2
from tests.worker.cli_process import SUBPROCESS_ENV, run_cli
from tests.worker.conftest import StartWorker


def test_termination_message_on_a_missing_model(tmp_path: Path) -> None:
    reason_file = tmp_path / "termination-log"
    missing = tmp_path / "no-such-model"
    result = run_cli(
        "--runner",
        "ar",
        "--backend",
        "transformers",
        "--model",
        str(missing),
        "--termination-log",
        str(reason_file),
    )
    assert result.returncode != 0
    reason = reason_file.read_text()
    assert reason.count("\n") == 1  # one line
    assert f"--model: model directory '{missing}' does not exist" in reason


def test_termination_message_from_the_environment(tmp_path: Path) -> None:
    reason_file = tmp_path / "reason"
    env = {**SUBPROCESS_ENV, "OMNISTAGE_TERMINATION_LOG": str(reason_file)}
    result = run_cli("--backend", "transformers", "--model", ".", env=env)
    assert result.returncode == 2
    assert "--runner" in reason_file.read_text()


def test_termination_message_when_the_server_cannot_start(tmp_path: Path, lm_dir: Path) -> None:
    import socket

    reason_file = tmp_path / "reason"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_cli(
            "--runner",
            "ar",
            "--backend",
            "transformers",
            "--model",
            str(lm_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--termination-log",
            str(reason_file),
        )
    assert result.returncode == 1, result.stderr
    assert reason_file.read_text().startswith("worker failed:")


async def test_termination_message_when_loading_fails(
    start_worker: StartWorker, tmp_path: Path
) -> None:
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    reason_file = tmp_path / "reason"
    worker = await start_worker(empty, "ar", "transformers", termination_log=reason_file)
    status = await worker.status()
    assert status.state == types_pb2.WORKER_STATE_FAILED
    assert reason_file.read_text() == f"worker failed: {status.error}\n"


def test_termination_log_path(tmp_path: Path) -> None:
    from omnistage_worker.control import termination

    absent = tmp_path / "dev" / "termination-log"
    assert termination.resolve(None, default=absent) is None  # outside a pod: nowhere
    absent.parent.mkdir()
    absent.touch()  # the kubelet provides the file
    assert termination.resolve(None, default=absent) == absent
    assert termination.resolve("", default=absent) is None  # turned off
    assert termination.resolve("/x/y") == Path("/x/y")
    argv = ["--model", ".", "--termination-log", "/a", "--termination-log=/b"]
    assert termination.from_argv(argv, {}) == "/b"
    assert termination.from_argv([], {"OMNISTAGE_TERMINATION_LOG": "/c"}) == "/c"
    assert termination.one_line("a\n  b") == "a b"
    assert len(termination.one_line("x" * 10_000).encode()) <= termination.LIMIT
