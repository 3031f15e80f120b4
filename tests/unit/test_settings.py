"""Operator flags and their environment defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

from omnistage_operator.settings import SettingsError, parse_settings


def test_defaults_follow_the_contract() -> None:
    s = parse_settings([], {})
    assert s.namespaces == ()
    assert (s.metrics_port, s.liveness_port) == (8080, 8081)
    assert s.peering is None and s.placement == "dra" and s.device_class == "gpu.nvidia.com"
    assert (s.sleep_timeout_s, s.wake_timeout_s, s.ack_retries) == (60.0, 600.0, 3)
    assert s.worker_token() is None


def test_environment_and_flags(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    env = {
        "OMNISTAGE_NAMESPACES": "a, b",
        "OMNISTAGE_WORKER_TOKEN_FILE": str(token),
        "OMNISTAGE_METRICS_PORT": "9100",
        "OMNISTAGE_PEERING": "omnistage",
    }
    s = parse_settings(["--liveness-port", "9101", "--ack-retries", "5"], env)
    assert s.namespaces == ("a", "b")
    assert (s.metrics_port, s.liveness_port, s.ack_retries) == (9100, 9101, 5)
    assert s.peering == "omnistage"
    assert s.worker_token() == "s3cret"
    assert parse_settings(["--namespace", "x", "--namespace", "y"], env).namespaces == ("x", "y")


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["--metrics-port", "http"], "--metrics-port"),
        (["--liveness-port", "70000"], "--liveness-port"),
        (["--sleep-timeout", "-1"], "--sleep-timeout"),
        (["--ack-retries", "0"], "--ack-retries"),
    ],
)
def test_bad_values_name_the_flag(argv: list[str], field: str) -> None:
    with pytest.raises(SettingsError, match=field):
        parse_settings(argv, {})


def test_empty_token_file_is_refused(tmp_path: Path) -> None:
    empty = tmp_path / "token"
    empty.write_text("\n")
    with pytest.raises(SettingsError, match="empty"):
        parse_settings(["--worker-token-file", str(empty)], {}).worker_token()
