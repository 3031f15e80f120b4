"""The ``omnistage-worker`` command's flags and environment: errors name the flag, defaults,
bounds, abbreviations refused."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from omnistage_worker.cli import build_parser, config_from_args
from omnistage_worker.config import ConfigError
from tests.worker.cli_process import run_cli


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
