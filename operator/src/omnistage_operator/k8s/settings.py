"""Operator settings: command-line flags with environment defaults (the operator contract)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from omnistage_operator.decisions.election import Timing, TimingError
from omnistage_operator.k8s.worker_credentials import (
    CredentialsError,
    ProjectedToken,
    SharedToken,
    WorkerCredentials,
)
from omnistage_worker.jsonlog import LOG_FORMATS

__all__ = ["Settings", "SettingsError", "parse_settings"]


_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
ROUND_WAIT_MAX_S = 600.0  # the chart's schema has the same bounds


class SettingsError(ValueError):
    """A flag or environment variable has an invalid value."""


@dataclass(frozen=True)
class Settings:
    """Everything the operator process is configured with."""

    namespaces: tuple[str, ...] = ()  # empty: all namespaces
    worker_token_file: str | None = None
    # Kubernetes-issued credentials instead of the shared token (worker_credentials.py).
    worker_identity_token_file: str | None = None
    worker_token_audience: str = "omnistage-worker"
    worker_tls_ca: str | None = None
    metrics_port: int = 8080
    liveness_port: int = 8081
    peering: str | None = None  # None: standalone
    placement: str = "dra"
    device_class: str = "gpu.nvidia.com"
    sleep_timeout_s: float = 60.0
    wake_timeout_s: float = 600.0
    ack_retries: int = 3
    status_timeout_s: float = 3.0
    fence_timeout_s: float = 120.0
    resync_interval_s: float = 10.0
    # How long a group's round waits for the sleeps it sent without requests in flight before
    # it goes on (a draining sleep never holds the round; a later round takes its ACK).
    round_wait_s: float = 5.0
    wake_margin_bytes: int = 64 << 20
    # Overlapped hand-overs (handover.overlap), where both workers can take part (claim_limits);
    # on since 1000 of them held the room under the GPU host's outside sampler.
    overlapped_handover: bool = True
    # A node directory under which each group's worker pods share one (hostPath): an overlapped
    # hand-over between them then hands the device pieces over instead of freeing them. Empty:
    # no hand-off (the pieces are freed and taken anew).
    handoff_host_path: str = ""
    retry_backoff_s: float = 0.25
    # Leader election (leader.Elector); off: this process is the sole writer (epoch 0).
    leader_election: bool = True
    lease_name: str = "omnistage-operator"
    lease_namespace: str | None = None  # None: $POD_NAMESPACE, else the first --namespace
    lease_duration_s: float = 15.0
    renew_deadline_s: float = 10.0
    retry_period_s: float = 2.0
    log_format: str = "text"  # or "json": one object per line (omnistage_worker.jsonlog)
    log_level: str = "INFO"

    def election_timing(self) -> Timing:
        """The election's timing (validated when the settings were parsed)."""
        return Timing(self.lease_duration_s, self.renew_deadline_s, self.retry_period_s)

    def lease_namespace_or(self, fallback: str) -> str:
        """Where the Lease lives: the flag, else the first served namespace, else ``fallback``
        (the client's default namespace)."""
        if self.lease_namespace:
            return self.lease_namespace
        return self.namespaces[0] if self.namespaces else fallback

    def worker_credentials(self) -> WorkerCredentials:
        """What the operator presents to workers (the file is read and checked now)."""
        if self.worker_identity_token_file is None:
            return SharedToken(self.worker_token())
        creds = ProjectedToken(self.worker_identity_token_file, self.worker_token_audience)
        try:
            creds.identity  # noqa: B018 - read and check it now
        except CredentialsError as exc:
            raise SettingsError(str(exc)) from exc
        return creds

    def worker_token(self) -> str | None:
        """The bearer token the workers expect (read fresh; never logged)."""
        if self.worker_token_file is None:
            return None
        with open(self.worker_token_file, encoding="utf-8") as f:
            token = f.read().strip()
        if not token:
            raise SettingsError(f"--worker-token-file {self.worker_token_file} is empty")
        return token


def _positive(value: str, flag: str, kind: type[float] | type[int]) -> float | int:
    try:
        number = kind(value)
    except ValueError:
        raise SettingsError(f"{flag}: expected a number, got {value!r}") from None
    if number < 0 or (kind is int and number == 0 and flag != "--wake-margin-bytes"):
        raise SettingsError(f"{flag}: must be positive, got {value!r}")
    return number


def _round_wait(value: str) -> float:
    seconds = float(_positive(value, "--round-wait", float))
    if not 0 < seconds <= ROUND_WAIT_MAX_S:
        raise SettingsError(
            f"--round-wait: must be more than 0 and at most {ROUND_WAIT_MAX_S:.0f} seconds, "
            f"got {value!r}"
        )
    return seconds


def _flag(value: str, name: str) -> bool:
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise SettingsError(f"{name}: expected true or false, got {value!r}")


def _node_dir(path: str) -> str:
    """An absolute node directory without a trailing ``/`` (the root stays ``/``); empty
    stays empty (none)."""
    return path.rstrip("/") or ("/" if path else "")


def parse_settings(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> Settings:
    """Parse flags (``argv`` without the program name); unset flags come from ``environ``."""
    env = os.environ if environ is None else environ
    p = argparse.ArgumentParser(
        prog="omnistage-operator",
        description="Runs OmniStage stages and time-shares GPU memory between them.",
    )
    p.add_argument("--namespace", action="append", default=None, help="repeatable; default all")
    p.add_argument("--worker-token-file", default=env.get("OMNISTAGE_WORKER_TOKEN_FILE"))
    p.add_argument(
        "--worker-identity-token-file",
        default=env.get("OMNISTAGE_WORKER_IDENTITY_TOKEN_FILE"),
        help="present this Kubernetes-issued token (projected, audience --worker-token-audience)"
        " instead of the shared --worker-token-file; workers check it by TokenReview",
    )
    p.add_argument(
        "--worker-token-audience",
        default=env.get("OMNISTAGE_WORKER_TOKEN_AUDIENCE", "omnistage-worker"),
    )
    p.add_argument("--worker-tls-ca", default=env.get("OMNISTAGE_WORKER_TLS_CA"))
    p.add_argument("--metrics-port", default=env.get("OMNISTAGE_METRICS_PORT", "8080"))
    p.add_argument("--liveness-port", default=env.get("OMNISTAGE_LIVENESS_PORT", "8081"))
    p.add_argument("--peering", default=env.get("OMNISTAGE_PEERING") or None)
    p.add_argument(
        "--placement", choices=("dra", "explicit"), default=env.get("OMNISTAGE_PLACEMENT", "dra")
    )
    p.add_argument("--device-class", default=env.get("OMNISTAGE_DEVICE_CLASS", "gpu.nvidia.com"))
    p.add_argument("--sleep-timeout", default=env.get("OMNISTAGE_SLEEP_TIMEOUT", "60"))
    p.add_argument("--wake-timeout", default=env.get("OMNISTAGE_WAKE_TIMEOUT", "600"))
    p.add_argument("--ack-retries", default=env.get("OMNISTAGE_ACK_RETRIES", "3"))
    p.add_argument("--fence-timeout", default=env.get("OMNISTAGE_FENCE_TIMEOUT", "120"))
    p.add_argument("--resync-interval", default=env.get("OMNISTAGE_RESYNC_INTERVAL", "10"))
    p.add_argument(
        "--round-wait",
        default=env.get("OMNISTAGE_ROUND_WAIT", "5"),
        help="seconds a group's round waits for the sleeps it sent (no requests in flight) "
        "before going on; a later round takes their ACKs",
    )
    p.add_argument(
        "--wake-margin-bytes", default=env.get("OMNISTAGE_WAKE_MARGIN_BYTES", str(64 << 20))
    )
    p.add_argument(
        "--overlapped-handover",
        action=argparse.BooleanOptionalAction,
        default=_flag(
            env.get("OMNISTAGE_OVERLAPPED_HANDOVER", "true"), "OMNISTAGE_OVERLAPPED_HANDOVER"
        ),
        help="wake the next stage beside the sleep of the one it replaces, under a claim limit "
        "raised by each release the sleep reports, where both workers can (default on; "
        "--no-overlapped-handover: every wake waits for the sleep's ACK)",
    )
    p.add_argument(
        "--handoff-host-path",
        default=env.get("OMNISTAGE_HANDOFF_HOST_PATH", ""),
        help="a node directory (absolute) under which each group's worker pods share a "
        "hand-off directory (hostPath <path>/<namespace>/<group>): an overlapped hand-over "
        "hands its device pieces from one worker to the other instead of freeing them; the "
        "namespaces must allow hostPath volumes. Empty (default): no hand-off",
    )
    p.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default=env.get("OMNISTAGE_LOG_FORMAT") or "text",
        help="text lines, or one JSON object per line",
    )
    p.add_argument("--log-level", default=env.get("OMNISTAGE_LOG_LEVEL") or "INFO")
    election = p.add_argument_group("leader election (one replica orders the workers)")
    election.add_argument(
        "--leader-election",
        action=argparse.BooleanOptionalAction,
        default=_flag(env.get("OMNISTAGE_LEADER_ELECTION", "true"), "OMNISTAGE_LEADER_ELECTION"),
        help="hold a coordination.k8s.io Lease before ordering workers (default on); off: this "
        "process is the only writer and its orders carry epoch 0",
    )
    election.add_argument(
        "--lease-name", default=env.get("OMNISTAGE_LEASE_NAME", "omnistage-operator")
    )
    election.add_argument(
        "--lease-namespace",
        default=env.get("OMNISTAGE_LEASE_NAMESPACE") or env.get("POD_NAMESPACE") or None,
        help="default: $POD_NAMESPACE, else the first --namespace, else the kubeconfig's",
    )
    election.add_argument("--lease-duration", default=env.get("OMNISTAGE_LEASE_DURATION", "15"))
    election.add_argument("--renew-deadline", default=env.get("OMNISTAGE_RENEW_DEADLINE", "10"))
    election.add_argument("--retry-period", default=env.get("OMNISTAGE_RETRY_PERIOD", "2"))
    a = p.parse_args(list(argv) if argv is not None else None)
    timing = [
        float(_positive(a.lease_duration, "--lease-duration", float)),
        float(_positive(a.renew_deadline, "--renew-deadline", float)),
        float(_positive(a.retry_period, "--retry-period", float)),
    ]
    try:
        Timing(*timing)
    except TimingError as exc:
        raise SettingsError(f"--lease-duration/--renew-deadline/--retry-period: {exc}") from None
    if not a.lease_name:
        raise SettingsError("--lease-name: must not be empty")
    level = str(a.log_level).upper()
    if level not in _LOG_LEVELS:
        raise SettingsError(f"--log-level: one of {', '.join(_LOG_LEVELS)}, got {a.log_level!r}")
    namespaces = a.namespace or [
        ns.strip() for ns in env.get("OMNISTAGE_NAMESPACES", "").split(",") if ns.strip()
    ]
    ports = {}
    for flag, value in (("--metrics-port", a.metrics_port), ("--liveness-port", a.liveness_port)):
        port = int(_positive(value, flag, int))
        if port > 65535:
            raise SettingsError(f"{flag}: must be at most 65535, got {value!r}")
        ports[flag] = port
    if a.handoff_host_path and not a.handoff_host_path.startswith("/"):
        raise SettingsError(
            f"--handoff-host-path: must be an absolute path, got {a.handoff_host_path!r}"
        )
    if a.worker_identity_token_file and a.worker_token_file:
        raise SettingsError(
            "--worker-identity-token-file: give it or --worker-token-file, not both"
        )
    return Settings(
        namespaces=tuple(namespaces),
        worker_token_file=a.worker_token_file or None,
        worker_identity_token_file=a.worker_identity_token_file or None,
        worker_token_audience=a.worker_token_audience,
        worker_tls_ca=a.worker_tls_ca or None,
        metrics_port=ports["--metrics-port"],
        liveness_port=ports["--liveness-port"],
        peering=a.peering,
        placement=a.placement,
        device_class=a.device_class,
        sleep_timeout_s=float(_positive(a.sleep_timeout, "--sleep-timeout", float)),
        wake_timeout_s=float(_positive(a.wake_timeout, "--wake-timeout", float)),
        ack_retries=int(_positive(a.ack_retries, "--ack-retries", int)),
        fence_timeout_s=float(_positive(a.fence_timeout, "--fence-timeout", float)),
        resync_interval_s=float(_positive(a.resync_interval, "--resync-interval", float)),
        round_wait_s=_round_wait(a.round_wait),
        wake_margin_bytes=int(_positive(a.wake_margin_bytes, "--wake-margin-bytes", int)),
        overlapped_handover=bool(a.overlapped_handover),
        handoff_host_path=_node_dir(a.handoff_host_path),
        leader_election=bool(a.leader_election),
        lease_name=a.lease_name,
        lease_namespace=a.lease_namespace or None,
        lease_duration_s=timing[0],
        renew_deadline_s=timing[1],
        retry_period_s=timing[2],
        log_format=a.log_format,
        log_level=level,
    )
