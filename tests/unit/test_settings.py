"""Operator flags and their environment defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

from omnistage_operator.k8s.settings import SettingsError, parse_settings


def test_defaults_follow_the_contract() -> None:
    s = parse_settings([], {})
    assert s.namespaces == ()
    assert (s.metrics_port, s.liveness_port) == (8080, 8081)
    assert s.peering is None and s.placement == "dra" and s.device_class == "gpu.nvidia.com"
    assert (s.sleep_timeout_s, s.wake_timeout_s, s.ack_retries) == (60.0, 600.0, 3)
    assert s.round_wait_s == 5.0
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
        (["--round-wait", "0"], "--round-wait"),
        (["--round-wait", "-2"], "--round-wait"),
        (["--round-wait", "601"], "--round-wait"),
        (["--round-wait", "soon"], "--round-wait"),
    ],
)
def test_bad_values_name_the_flag(argv: list[str], field: str) -> None:
    with pytest.raises(SettingsError, match=field):
        parse_settings(argv, {})


def test_the_round_wait_from_flag_or_environment_reaches_the_groups_round_policy() -> None:
    from omnistage_operator.runtime.runner import GroupRunner

    assert parse_settings([], {"OMNISTAGE_ROUND_WAIT": "0.5"}).round_wait_s == 0.5
    s = parse_settings(["--round-wait", "12"], {"OMNISTAGE_ROUND_WAIT": "0.5"})
    assert s.round_wait_s == 12.0
    runner = GroupRunner(object(), s)  # type: ignore[arg-type]  # no API call is made
    assert runner.policy.round_wait_s == 12.0
    with pytest.raises(SettingsError, match="--round-wait"):
        parse_settings([], {"OMNISTAGE_ROUND_WAIT": "0"})


def test_empty_token_file_is_refused(tmp_path: Path) -> None:
    empty = tmp_path / "token"
    empty.write_text("\n")
    with pytest.raises(SettingsError, match="empty"):
        parse_settings(["--worker-token-file", str(empty)], {}).worker_token()


def test_leader_election_defaults() -> None:
    s = parse_settings([], {})
    assert s.leader_election is True
    assert (s.lease_duration_s, s.renew_deadline_s, s.retry_period_s) == (15.0, 10.0, 2.0)
    assert s.lease_name == "omnistage-operator" and s.lease_namespace is None
    assert s.lease_namespace_or("fallback") == "fallback"
    assert parse_settings(["--namespace", "team-a"], {}).lease_namespace_or("x") == "team-a"
    # In a pod, the Lease lives in the operator's own namespace.
    assert (
        parse_settings([], {"POD_NAMESPACE": "omnistage-system"}).lease_namespace_or("x")
        == "omnistage-system"
    )


def test_leader_election_flags_and_environment() -> None:
    env = {
        "OMNISTAGE_LEADER_ELECTION": "false",
        "OMNISTAGE_LEASE_NAME": "ops",
        "OMNISTAGE_LEASE_NAMESPACE": "sys",
        "POD_NAMESPACE": "ignored",
        "OMNISTAGE_LEASE_DURATION": "3",
        "OMNISTAGE_RENEW_DEADLINE": "2",
        "OMNISTAGE_RETRY_PERIOD": "0.5",
    }
    s = parse_settings([], env)
    assert not s.leader_election and s.lease_name == "ops" and s.lease_namespace == "sys"
    assert s.election_timing().lease_seconds == 3
    assert (s.lease_duration_s, s.renew_deadline_s, s.retry_period_s) == (3.0, 2.0, 0.5)
    assert parse_settings(["--leader-election"], env).leader_election is True
    assert parse_settings(["--no-leader-election"], {}).leader_election is False


@pytest.mark.parametrize(
    ("argv", "env", "match"),
    [
        (["--lease-duration", "10", "--renew-deadline", "10"], {}, "lease duration"),
        (["--renew-deadline", "2", "--retry-period", "2"], {}, "renew deadline"),
        (["--retry-period", "-1"], {}, "--retry-period"),
        ([], {"OMNISTAGE_LEADER_ELECTION": "maybe"}, "OMNISTAGE_LEADER_ELECTION"),
        (["--lease-name", ""], {}, "--lease-name"),
    ],
)
def test_unsafe_election_settings_are_refused(
    argv: list[str], env: dict[str, str], match: str
) -> None:
    with pytest.raises(SettingsError, match=match):
        parse_settings(argv, env)
