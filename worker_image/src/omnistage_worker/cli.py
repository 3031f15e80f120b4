"""``omnistage-worker``: parse flags, validate them (exit 2 naming the flag), then serve.

A fatal start error (a bad flag, a missing model directory, a server that cannot start) is
also written, as one line, to the termination message (:mod:`omnistage_worker.control.termination`),
so the pod's status says why the worker exited. A model that fails to load does not end the
process: the worker stays up FAILED (GetStatus and every refusal carry the reason, liveness
reads NOT_SERVING) and writes the same termination message, shown once the pod ends.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NoReturn

from omnistage_worker.config import (
    ACTIVATIONS,
    BACKENDS,
    DEFAULT_DRAIN_TIMEOUT_S,
    DEFAULT_HOLD_TIMEOUT_S,
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_HELD,
    DEFAULT_PORT,
    DEFAULT_RESIDUAL_SLACK,
    ConfigError,
    Identity,
    WorkerConfig,
    parse_byte_flag,
    parse_device,
    read_token,
)
from omnistage_worker.control import prestart, termination
from omnistage_worker.dtype_choices import DTYPES
from omnistage_worker.flag_groups import limit_flags, request_limits, vllm_args, vllm_flags
from omnistage_worker.host_allocator import fix_mmap_threshold
from omnistage_worker.jsonlog import LOG_FORMATS, JsonFormatter, configure_logging
from omnistage_worker.serving.kube_access import KubeconfigError, access_from_kubeconfig
from omnistage_worker.serving.token_review import in_cluster_server
from omnistage_worker.stray_output import capture_stray_output, real_stream
from omnistage_worker.token_review_settings import DEFAULT_AUDIENCE, SA_DIR, TokenReviewSettings

log = logging.getLogger("omnistage_worker")


class Parser(argparse.ArgumentParser):
    """An argument parser whose refusals also go to the termination message."""

    termination_log: Path | None = None

    def error(self, message: str) -> NoReturn:
        termination.write(self.termination_log, f"{self.prog}: {message}")
        super().error(message)


def build_parser(env: Mapping[str, str]) -> Parser:
    """The argument parser; defaults that come from the environment are read from ``env``."""
    p = Parser(
        prog="omnistage-worker",
        description="Serve one model stage over gRPC and sleep/wake it with measured ACKs.",
        # No abbreviations: "--gpu 1" must not stand for --gpus (the operator owns that flag,
        # and the CRD refuses it and its prefixes; an unknown flag is refused here).
        allow_abbrev=False,
    )
    p.add_argument("--runner", required=True, choices=("diffusion", "ar"))
    p.add_argument("--backend", required=True, choices=BACKENDS)
    p.add_argument("--model", required=True, type=Path, help="local model directory")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument(
        "--gpus",
        type=int,
        default=int(env.get("OMNISTAGE_GPUS") or 1),
        help="devices the model spans, from --device on (cuda:N..N+gpus-1; on cpu: simulated)",
    )
    p.add_argument("--dtype", default="auto", choices=DTYPES)
    p.add_argument("--variant", help="weight file variant to load, e.g. fp16 (x.fp16.safetensors)")
    p.add_argument(
        "--components",
        default="",
        help="comma-separated pipeline components that sleep separately (dotted paths allowed; "
        "default: discovered from the pipeline)",
    )
    p.add_argument(
        "--sequential",
        action="store_true",
        help="diffusion: only one component resident at a time inside a request",
    )
    p.add_argument("--initial-state", default="active", choices=("active", "asleep"))
    p.add_argument("--sleep-level", type=int, default=1, choices=(1, 2))
    p.add_argument("--token-file", type=Path, help="bearer token required by SleepService")
    p.add_argument(
        "--operator-identity",
        help="accept Kubernetes-issued tokens of this user only (system:serviceaccount:<ns>:<name>"
        ", checked by TokenReview) instead of --token-file",
    )
    p.add_argument("--token-audience", default=DEFAULT_AUDIENCE)
    p.add_argument("--kube-server", default=None, help="API server URL (default: in-cluster)")
    p.add_argument("--kube-token-file", type=Path, default=SA_DIR / "token")
    p.add_argument("--kube-ca-file", type=Path, default=SA_DIR / "ca.crt")
    p.add_argument("--tls-cert", type=Path)
    p.add_argument("--tls-key", type=Path)
    p.add_argument(
        "--health-port",
        type=int,
        default=None,
        help="also serve gRPC health in plaintext on this port, for kubelet probes beside a TLS "
        "--port (default: off)",
    )
    p.add_argument(
        "--residual-slack",
        default=env.get("OMNISTAGE_RESIDUAL_SLACK") or str(DEFAULT_RESIDUAL_SLACK),
        help="bytes allowed above the baseline after a sleep (default $OMNISTAGE_RESIDUAL_SLACK, "
        "else 128Mi)",
    )
    p.add_argument("--stage", default=env.get("OMNISTAGE_STAGE", ""))
    p.add_argument("--pod", default=env.get("POD_NAME", ""))
    p.add_argument("--namespace", default=env.get("POD_NAMESPACE", ""))
    p.add_argument("--node", default=env.get("NODE_NAME", ""))
    p.add_argument(
        "--epoch",
        type=int,
        default=0,
        help="the group's leadership epoch when the pod was made: orders from older epochs, "
        "and epoch 0 (no election) once this is above 0, are refused from the start",
    )
    p.add_argument("--rank", type=int, default=int(env.get("OMNISTAGE_RANK", "0") or 0))
    p.add_argument(
        "--cpu-threads",
        type=int,
        default=int(env["OMNISTAGE_CPU_THREADS"]) if env.get("OMNISTAGE_CPU_THREADS") else None,
        help="torch intra-op threads (default: torch's choice); set it when workers share cores",
    )
    p.add_argument("--shutdown-grace", type=float, default=30.0, help="seconds (SIGTERM)")
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=float(env.get("OMNISTAGE_DRAIN_TIMEOUT") or DEFAULT_DRAIN_TIMEOUT_S),
        help="seconds a sleep waits for in-flight requests when the Sleep request sets no "
        "drain_timeout of its own (default 600)",
    )
    p.add_argument(
        termination.FLAG,
        default=env.get(termination.ENV),
        help="file for a one-line reason when the worker gives up (default: "
        "/dev/termination-log when the kubelet provides it; empty: none)",
    )
    p.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="serve the OpenAI-compatible HTTP API on this port (default: off)",
    )
    p.add_argument("--served-model-name", default="", help="OpenAI model name (default: stage)")
    p.add_argument(
        "--activation",
        default="manual",
        choices=ACTIVATIONS,
        help="ondemand: hold requests while asleep or waking until the operator wakes the stage",
    )
    p.add_argument(
        "--hold-timeout",
        type=float,
        default=DEFAULT_HOLD_TIMEOUT_S,
        help="seconds a held request waits before UNAVAILABLE / 503",
    )
    p.add_argument("--max-held", type=int, default=DEFAULT_MAX_HELD, help="bound of the hold queue")
    p.add_argument(
        "--max-batch",
        type=int,
        default=int(env.get("OMNISTAGE_MAX_BATCH") or DEFAULT_MAX_BATCH),
        help="requests a torch stage runs together: rows of the AR batch, images of one "
        f"diffusion call (default {DEFAULT_MAX_BATCH})",
    )
    p.add_argument(
        "--no-decode-graphs",
        dest="decode_graphs",
        action="store_false",
        help="AR on one GPU: run every decode step eagerly instead of replaying CUDA graphs",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics on this port (default: off)",
    )
    p.add_argument("--log-level", default=env.get("OMNISTAGE_LOG_LEVEL", "INFO"))
    p.add_argument(
        "--log-format",
        default=env.get("OMNISTAGE_LOG_FORMAT") or "text",
        choices=LOG_FORMATS,
        help="text lines, or one JSON object per line (default $OMNISTAGE_LOG_FORMAT, else text)",
    )
    vllm_flags(p)
    limit_flags(p)
    return p


def _token_review(args: argparse.Namespace) -> TokenReviewSettings | None:
    """TokenReview settings when ``--operator-identity`` is given (raises ConfigError)."""
    if not args.operator_identity:
        return None
    server, token_file, ca_file = args.kube_server, args.kube_token_file, args.kube_ca_file
    try:
        if not server and not in_cluster_server() and os.environ.get("KUBECONFIG"):
            server, token_file, ca_file = access_from_kubeconfig(Path(os.environ["KUBECONFIG"]))
        return TokenReviewSettings(
            operator_identity=args.operator_identity,
            audience=args.token_audience,
            server=server or in_cluster_server(),
            token_file=token_file,
            ca_file=ca_file,
        )
    except KubeconfigError as exc:
        raise ConfigError("--kube-server", str(exc)) from exc
    except ValueError as exc:
        flag, _, message = str(exc).partition(": ")
        raise ConfigError(flag, message) from exc


def config_from_args(args: argparse.Namespace) -> WorkerConfig:
    """Turn parsed flags into a validated :class:`WorkerConfig` (raises :class:`ConfigError`)."""
    device = parse_device(args.device)
    token = read_token(args.token_file) if args.token_file is not None else None
    return WorkerConfig(
        runner=args.runner,
        backend=args.backend,
        model=args.model,
        host=args.host,
        port=args.port,
        device=device,
        initial_state=args.initial_state,
        sleep_level=args.sleep_level,
        token=token,
        token_review=_token_review(args),
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        health_port=args.health_port,
        residual_slack=parse_byte_flag(args.residual_slack, "--residual-slack"),
        identity=Identity(
            stage=args.stage,
            namespace=args.namespace,
            pod=args.pod,
            rank=args.rank,
            node=args.node,
        ),
        dtype=args.dtype,
        variant=args.variant or None,
        components=tuple(c.strip() for c in args.components.split(",") if c.strip()),
        sequential=args.sequential,
        shutdown_grace_s=args.shutdown_grace,
        drain_timeout_s=args.drain_timeout,
        cpu_threads=args.cpu_threads,
        gpus=args.gpus,
        termination_log=termination.resolve(args.termination_log),
        vllm=vllm_args(args),
        http_port=args.http_port,
        served_model_name=args.served_model_name,
        activation=args.activation,
        hold_timeout_s=args.hold_timeout,
        max_held=args.max_held,
        max_batch=args.max_batch,
        decode_graphs=args.decode_graphs,
        limits=request_limits(args),
        http_token=(
            read_token(args.http_token_file, "--http-token-file")
            if args.http_token_file is not None
            else None
        ),
        epoch=args.epoch,
        metrics_port=args.metrics_port,
    )


def setup_logging(level: str, form: str = "text", identity: Identity | None = None) -> None:
    """Progress lines on stderr: text, or JSON objects carrying the worker's identity."""
    fields = {} if identity is None else {"stage": identity.stage, "pod": identity.pod}
    own = {k: v for k, v in fields.items() if v}
    configure_logging(real_stream(sys.stderr), level, form, own)
    if form == "json":
        # Progress bars (model loading) are not log lines; tqdm reads this when imported.
        os.environ.setdefault("TQDM_DISABLE", "1")
        # Libraries' own handlers and prints (transformers, diffusers, vLLM) become JSON too.
        capture_stray_output(JsonFormatter(own))


def run_loop(config: WorkerConfig) -> int:
    """:func:`run` on an event loop: uvloop for a vLLM stage where it is installed (vLLM's
    own server runs on it; vLLM depends on it), unless ``OMNISTAGE_UVLOOP=0``."""
    if config.backend == "vllm" and os.environ.get("OMNISTAGE_UVLOOP", "1") != "0":
        try:
            import uvloop  # type: ignore[import-not-found,unused-ignore]
        except ImportError:
            pass
        else:
            log.info("event loop: uvloop")
            code: int = uvloop.run(run(config))
            return code
    return asyncio.run(run(config))


async def run(config: WorkerConfig) -> int:
    """Serve until SIGTERM or SIGINT, then shut down gracefully; the exit code."""
    from omnistage_worker.serving.server import WorkerServer

    server = WorkerServer(config)
    prestart.mark("imports done")
    port = await server.start()
    log.info("listening on %s:%d", config.host, port)
    prestart.mark("gRPC serving")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("signal received: shutting down (grace %.1fs)", config.shutdown_grace_s)
    await server.stop(config.shutdown_grace_s)
    log.info("stopped")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``omnistage-worker``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(os.environ)
    # Known before parsing, so a refusal of any flag reaches the termination message too.
    parser.termination_log = termination.resolve(termination.from_argv(argv, os.environ))
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        parser.error(str(exc))
    setup_logging(args.log_level, args.log_format, config.identity)
    if config.backend != "vllm":
        # For the weight engine's host copies; vLLM's weights live in its engine process, so a
        # vLLM stage's worker keeps glibc's defaults, as vLLM's own server does.
        fix_mmap_threshold()
    prestart.begin(config)
    log.info(
        "starting: runner=%s backend=%s model=%s device=%s initial-state=%s sleep-level=%d",
        config.runner,
        config.backend,
        config.model,
        config.device,
        config.initial_state,
        config.sleep_level,
    )
    try:
        return run_loop(config)
    except Exception as exc:
        log.exception("the worker could not start or failed")
        termination.write(config.termination_log, f"worker failed: {exc}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
