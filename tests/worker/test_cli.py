"""The ``omnistage-worker`` command: flag errors, a real subprocess, SIGTERM, a shared device."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from omnistage.worker.v1 import types_pb2
from omnistage_worker.cli import build_parser, config_from_args
from omnistage_worker.config import ConfigError
from tests.fakegpu.device import FakeGpu
from tests.fakegpu.model import Device
from tests.worker.conftest import StartWorker, WorkerHandle, wait_for

WORKER = [sys.executable, "-m", "omnistage_worker"]
FAKE_GPU_PROBE = "tests.fakegpu.probe:from_env"
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


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--runner", "ar", "--backend", "transformers", "--model", "/no/such/dir"], "--model"),
        (["--runner", "diffusion", "--backend", "transformers", "--model", "."], "--backend"),
        (["--runner", "ar", "--backend", "diffusers", "--model", "."], "--backend"),
        (["--runner", "gan", "--backend", "diffusers", "--model", "."], "--runner"),
        (
            ["--runner", "ar", "--backend", "transformers", "--model", ".", "--device", "tpu"],
            "--device",
        ),
        (
            # The simulated device is the test harness's (OMNISTAGE_MEMORY_PROBE), not a flag.
            [
                "--runner",
                "ar",
                "--backend",
                "transformers",
                "--model",
                ".",
                "--memory-capacity",
                "8Gi",
            ],
            "--memory-capacity",
        ),
        (
            [
                "--runner",
                "ar",
                "--backend",
                "transformers",
                "--model",
                ".",
                "--token-file",
                "/no/such/token",
            ],
            "--token-file",
        ),
        (
            [
                "--runner",
                "ar",
                "--backend",
                "transformers",
                "--model",
                ".",
                "--tls-cert",
                "pyproject.toml",
            ],
            "--tls-cert/--tls-key",
        ),
        (["--runner", "ar", "--backend", "vllm", "--model", "."], "--device"),
        (["--runner", "ar", "--backend", "vllm", "--model", ".", "--device", "cuda:1"], "--device"),
        (
            [
                "--runner",
                "ar",
                "--backend",
                "vllm",
                "--model",
                ".",
                "--device",
                "cuda",
                "--initial-state",
                "asleep",
            ],
            "--initial-state",
        ),
        (
            ["--runner", "ar", "--backend", "transformers", "--model", ".", "--sleep-level", "3"],
            "--sleep-level",
        ),
        (
            [
                "--runner",
                "ar",
                "--backend",
                "transformers",
                "--model",
                ".",
                "--residual-slack",
                "-5",
            ],
            "--residual-slack",
        ),
        (["--backend", "transformers", "--model", "."], "--runner"),
    ],
)
def test_cli_errors_name_the_flag(args: list[str], flag: str) -> None:
    result = run_cli(*args)
    assert result.returncode == 2, result.stderr
    assert flag in result.stderr
    assert "Traceback" not in result.stderr


def test_empty_token_file(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("  \n")
    result = run_cli(
        "--runner", "ar", "--backend", "transformers", "--model", ".", "--token-file", str(token)
    )
    assert result.returncode == 2
    assert "--token-file" in result.stderr and "empty" in result.stderr


def test_environment_defaults(tmp_path: Path) -> None:
    env = {
        "OMNISTAGE_STAGE": "painter",
        "POD_NAME": "painter-0",
        "POD_NAMESPACE": "ml",
        "NODE_NAME": "gpu-node-1",
        "OMNISTAGE_CPU_THREADS": "1",
    }
    args = build_parser(env).parse_args(
        ["--runner", "ar", "--backend", "transformers", "--model", str(tmp_path)]
    )
    config = config_from_args(args)
    identity = config.identity
    assert (identity.stage, identity.pod, identity.namespace, identity.node) == (
        "painter",
        "painter-0",
        "ml",
        "gpu-node-1",
    )
    assert identity.pid == os.getpid()
    assert config.cpu_threads == 1
    args = build_parser({}).parse_args(
        [
            "--runner",
            "ar",
            "--backend",
            "transformers",
            "--model",
            str(tmp_path),
            "--device",
            "cuda",
            "--residual-slack",
            "1 Gi",
        ]
    )
    with pytest.raises(ConfigError) as info:
        config_from_args(args)
    assert info.value.flag == "--residual-slack"


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


async def test_shared_device_and_sigterm(
    start_worker: StartWorker,
    diffusion_dir: Path,
    tmp_path: Path,
    spawn: list[Subprocess],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two workers share one simulated GPU; a wake that does not fit is refused; SIGTERM drains."""
    probe = await start_worker(diffusion_dir, "diffusion", "diffusers")
    footprint = (await probe.status()).used_bytes
    await probe.server.stop(0)
    gpu_dir = tmp_path / "gpu"
    # Room for one awake pipeline, not two (beside the driver reserve and two contexts).
    device = FakeGpu.create(gpu_dir, Device(uuid="GPU-cli", total=footprint * 3 // 2)).device()
    context, idle_free = device.context, device.total - device.reserve
    simulated = {"OMNISTAGE_MEMORY_PROBE": FAKE_GPU_PROBE, "OMNISTAGE_FAKE_GPU": str(gpu_dir)}
    for name, value in simulated.items():
        monkeypatch.setenv(name, value)

    a = await start_worker(diffusion_dir, "diffusion", "diffusers")
    b_proc = Subprocess(
        [
            "--runner",
            "diffusion",
            "--backend",
            "diffusers",
            "--model",
            str(diffusion_dir),
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--initial-state",
            "asleep",
            "--sleep-level",
            "1",
            "--stage",
            "b-stage",
            "--shutdown-grace",
            "20",
        ],
        tmp_path / "b.log",
        simulated,
    )
    spawn.append(b_proc)
    port = b_proc.port()
    b = WorkerHandle(a.server, grpc.aio.insecure_channel(f"127.0.0.1:{port}"))
    try:

        async def b_loaded() -> bool:
            try:
                return (await b.status()).state == types_pb2.WORKER_STATE_ASLEEP
            except grpc.aio.AioRpcError:
                return False

        await wait_for(b_loaded, within=60, what="the subprocess worker to load")
        b_status = await b.status()
        assert b_status.worker.stage == "b-stage"
        assert b_status.worker.pid == b_proc.proc.pid
        assert b_status.used_bytes == context  # asleep: its context only
        # It sees A's memory on the device: A's context and weights, and its own context.
        assert b_status.free_bytes == idle_free - 2 * context - footprint

        refused = await b.wake()
        assert not refused.ok
        assert "not enough free device memory" in refused.error
        assert refused.state == types_pb2.WORKER_STATE_ASLEEP

        assert (await a.sleep(1)).ok
        woke = await b.wake()
        assert woke.ok, woke.error
        assert woke.free_after_bytes == idle_free - 2 * context - footprint
        assert (await a.status()).free_bytes == idle_free - 2 * context - footprint
        a_refused = await a.wake()
        assert not a_refused.ok and "not enough free device memory" in a_refused.error

        # SIGTERM with a request in flight: health goes NOT_SERVING, the request finishes.
        health = health_pb2_grpc.HealthStub(b.channel)
        watch = health.Watch(health_pb2.HealthCheckRequest(service=""))
        first = await watch.read()
        assert first.status == health_pb2.HealthCheckResponse.SERVING
        long_call = asyncio.ensure_future(
            b.generate(prompt="a cat", seed=1, num_inference_steps=150)
        )

        async def running() -> bool:
            # In flight counts a request still on its way to the model, which a shutdown
            # answers "retry"; the model has taken it once the device charges its activations.
            status = await b.status()
            return status.inflight_requests == 1 and status.used_bytes > woke.used_after_bytes

        await wait_for(running, what="the long request to start")
        b_proc.proc.send_signal(signal.SIGTERM)
        update = await asyncio.wait_for(watch.read(), 10)
        assert update.status == health_pb2.HealthCheckResponse.NOT_SERVING
        watch.cancel()
        result = await long_call
        assert result.image.png.startswith(b"\x89PNG")
        returncode = await asyncio.to_thread(b_proc.proc.wait, 30)
        assert returncode == 0, b_proc.log.read_text()
        assert not (gpu_dir / "procs" / f"{b_proc.proc.pid}.json").exists()
        assert (await a.status()).free_bytes == idle_free - context  # B left the device
        log = b_proc.log.read_text()
        assert "started asleep at level 1" in log
        assert "shutting down" in log and "stopped" in log
    finally:
        await b.channel.close()


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


def test_gpus_flag_and_environment(tmp_path: Path) -> None:
    base = ["--runner", "ar", "--backend", "transformers", "--model", str(tmp_path)]
    config = config_from_args(
        build_parser({}).parse_args([*base, "--device", "cuda:2", "--gpus", "2"])
    )
    assert config.gpus == 2 and config.device.names(config.gpus) == ["cuda:2", "cuda:3"]
    config = config_from_args(build_parser({"OMNISTAGE_GPUS": "3"}).parse_args(base))
    assert config.gpus == 3 and config.device.names(3) == ["cpu", "cpu", "cpu"]
    for bad in ("0", "9"):
        with pytest.raises(ConfigError, match="--gpus"):
            config_from_args(build_parser({}).parse_args([*base, "--gpus", bad]))


def test_decode_graphs_on_by_default_and_off_by_flag(tmp_path: Path) -> None:
    base = ["--runner", "ar", "--backend", "transformers", "--model", str(tmp_path)]
    assert config_from_args(build_parser({}).parse_args(base)).decode_graphs
    off = build_parser({}).parse_args([*base, "--no-decode-graphs"])
    assert not config_from_args(off).decode_graphs


def test_max_batch_flag_environment_and_bounds(tmp_path: Path) -> None:
    base = ["--runner", "ar", "--backend", "transformers", "--model", str(tmp_path)]
    assert config_from_args(build_parser({}).parse_args(base)).max_batch == 32
    env = {"OMNISTAGE_MAX_BATCH": "8"}
    assert config_from_args(build_parser(env).parse_args(base)).max_batch == 8
    flagged = build_parser(env).parse_args([*base, "--max-batch", "64"])
    assert config_from_args(flagged).max_batch == 64
    for bad in ("0", "1025"):
        with pytest.raises(ConfigError, match="--max-batch"):
            config_from_args(build_parser({}).parse_args([*base, "--max-batch", bad]))


@pytest.mark.parametrize(
    "abbreviated",
    [["--gpu", "1"], ["--gpus=1", "--resid", "1Gi"], ["--initial", "active"], ["--epo", "3"]],
)
def test_abbreviated_flags_are_refused(
    tmp_path: Path, abbreviated: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """``--gpu 1`` must not stand for ``--gpus 1`` (argparse's default would accept it): an
    abbreviation of a flag the operator owns is an unknown flag, refused naming it (exit 2)."""
    base = ["--runner", "ar", "--backend", "transformers", "--model", str(tmp_path)]
    with pytest.raises(SystemExit) as exited:
        build_parser({}).parse_args([*base, *abbreviated])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments" in err and abbreviated[-2].split("=")[0] in err


def test_epoch_flag(tmp_path: Path) -> None:
    base = ["--runner", "ar", "--backend", "transformers", "--model", str(tmp_path)]
    assert config_from_args(build_parser({}).parse_args(base)).epoch == 0
    assert config_from_args(build_parser({}).parse_args([*base, "--epoch", "7"])).epoch == 7
    with pytest.raises(ConfigError, match="--epoch"):
        config_from_args(build_parser({}).parse_args([*base, "--epoch", "-1"]))
