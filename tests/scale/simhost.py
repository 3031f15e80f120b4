"""The simulated worker host: many omnistage workers in one process, for the scale harness.

``python -m tests.scale.simhost --socket PATH`` serves a control socket; localnode (started
with ``--sim-hosts K``) hands it the worker containers of its pods instead of starting one
process each. Each worker is the product's worker
(:class:`omnistage_worker.serving.server.WorkerServer`: state, ACKs with measured memory, epochs,
task-id replay, residual check, demand holding, gRPC SleepService, InferenceService, DemandService
and health) on its own podIP:port, with :mod:`tests.scale.simrunner` as its engine and
:mod:`tests.scale.simgpu` as its device.

What it does not cover (use the ordinary one-process-per-pod localnode for these):

- models and the weight engine: weights are a byte count, a move takes a fixed time;
- the OpenAI HTTP front (``--http-port`` is ignored), the Prometheus endpoint
  (``--metrics-port`` is ignored), TLS, vLLM, several devices per stage;
- overlapped hand-overs: the simulated engine takes no device memory piece by piece, so its
  workers say they cannot take part (``GetStatus.claim_limits`` false) and hand over serially;
- the simulated GPU's faults (leaks, lies, slow serving, tenants) and per-process isolation:
  workers share one interpreter, so one worker's CPU use delays the others on the host, a
  crash takes the host down, and every ACK carries the host's pid;
- per-worker logs: the host logs every worker to its own log; the container log holds a line
  saying so.

Protocol (JSON lines, both ways): ``{"op": "start", "key", "argv", "env"}`` and
``{"op": "stop", "key", "grace"}``; the host answers ``{"key", "event": "started"}`` once the
worker listens and ``{"key", "event": "exited", "code", "message"}`` when it is gone (a stop
with grace 0 is a SIGKILL: code 137).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import io
import json
import logging
import os
import signal
import sys
import types
from pathlib import Path
from typing import Any

from omnistage_worker import cli
from omnistage_worker.config import ConfigError, WorkerConfig
from omnistage_worker.memory import PROBE_ENV
from omnistage_worker.serving.server import WorkerServer
from tests.fakegpu.probe import ENV as FAKE_GPU_ENV
from tests.scale.simgpu import DEVICES
from tests.scale.simrunner import sim_runner

log = logging.getLogger("simhost")
KILLED = 137


def worker_config(argv: list[str], env: dict[str, str]) -> WorkerConfig:
    """The worker's config from its container args and env, as its own CLI would build it."""
    parser = cli.build_parser(env)
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            args = parser.parse_args(argv)
    except SystemExit:
        last = said.getvalue().strip().splitlines()[-1:] or ["refused"]
        raise ConfigError("args", last[0]) from None
    config = cli.config_from_args(args)
    # No HTTP front and no /metrics server: each is a uvicorn server waking 10 times a second,
    # hundreds of them in one process (nothing scrapes the simulated workers).
    return dataclasses.replace(config, http_port=None, metrics_port=None, termination_log=None)


class SimHost:
    """The workers of this process by key, and the control connection's writer."""

    def __init__(self) -> None:
        self.workers: dict[str, WorkerServer] = {}
        self.targets: dict[str, str] = {}
        self._stopping: dict[str, asyncio.Task[None]] = {}
        self._writer: asyncio.StreamWriter | None = None

    def send(self, message: dict[str, Any]) -> None:
        if self._writer is not None and not self._writer.is_closing():
            self._writer.write(json.dumps(message).encode() + b"\n")

    async def start(self, key: str, argv: list[str], env: dict[str, str]) -> None:
        """Start the worker of ``argv`` with the pod's ``env`` (its simulated devices are
        the directories localnode lists in ``$OMNISTAGE_FAKE_GPU``)."""
        devices = [d.strip() for d in env.get(FAKE_GPU_ENV, "").split(",") if d.strip()]
        try:
            config = worker_config(argv, env)
            target = f"{config.host}:{config.port}"
            DEVICES.assign(target, devices)
            server = WorkerServer(config, runner=sim_runner(config, env))
            self.workers[key] = server
            self.targets[key] = target
            await server.start()
        except Exception as exc:
            log.warning("worker %s could not start: %s", key, exc)
            self.workers.pop(key, None)
            target_of = self.targets.pop(key, None)
            if target_of:
                DEVICES.release(target_of)
            failed = f"worker failed: {exc}"
            self.send({"key": key, "event": "exited", "code": 1, "message": failed})
            return
        log.info("worker %s listening on %s", key, target)
        self.send({"key": key, "event": "started"})

    def stop(self, key: str, grace: float) -> None:
        if key in self._stopping:
            if grace <= 0:
                self._stopping[key].cancel()
            return
        self._stopping[key] = asyncio.create_task(self._stop(key, grace))

    async def _stop(self, key: str, grace: float) -> None:
        server = self.workers.get(key)
        code = 0 if grace > 0 else KILLED
        if server is not None:
            try:
                await asyncio.wait_for(server.stop(grace), grace + 5 if grace > 0 else 1)
            except (TimeoutError, asyncio.CancelledError):
                code = KILLED
                with contextlib.suppress(Exception):
                    await server.server.stop(0)
            except Exception:
                log.exception("worker %s stop failed", key)
        self.workers.pop(key, None)
        target = self.targets.pop(key, None)
        if target:
            DEVICES.release(target)
        self._stopping.pop(key, None)
        log.info("worker %s stopped (%d)", key, code)
        self.send({"key": key, "event": "exited", "code": code, "message": ""})

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One control connection (localnode's): requests until it closes."""
        self._writer = writer
        tasks: set[asyncio.Task[None]] = set()
        while line := await reader.readline():
            msg = json.loads(line)
            if msg["op"] == "start":
                task = asyncio.create_task(self.start(msg["key"], msg["argv"], msg["env"]))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            elif msg["op"] == "stop":
                self.stop(msg["key"], float(msg.get("grace", 30)))
        log.info("control connection closed: stopping %d worker(s)", len(self.workers))
        for key in list(self.workers):
            self.stop(key, 1.0)
        await asyncio.gather(*self._stopping.values(), return_exceptions=True)


async def _main(socket_path: Path) -> None:
    host = SimHost()
    done = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await host.serve(reader, writer)
        finally:
            done.set()

    server = await asyncio.start_unix_server(serve, path=str(socket_path))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, done.set)
    log.info("simulated worker host %d listening on %s", os.getpid(), socket_path)
    async with server:
        await done.wait()


def _without_torch() -> None:
    """The product's sharded-engine module (which imports torch, hundreds of MiB per host) is
    only read to ask whether a controller spans devices; no simulated stage does, so it is
    replaced by a module whose ShardedEngine nothing is an instance of."""
    stub = types.ModuleType("omnistage_worker.engine.sharded")

    class ShardedEngine:  # a simulated stage is never sharded
        pass

    stub.ShardedEngine = ShardedEngine  # type: ignore[attr-defined]
    sys.modules.setdefault(stub.__name__, stub)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.scale.simhost", description=__doc__)
    parser.add_argument("--socket", type=Path, required=True)
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--worker-log-level", default="WARNING", help="the workers' own logs")
    args = parser.parse_args(argv)
    os.environ[PROBE_ENV] = "tests.scale.simgpu:probe_for"
    _without_torch()
    logging.getLogger("omnistage_worker").setLevel(args.worker_log_level)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    asyncio.run(_main(args.socket))
    return 0


if __name__ == "__main__":
    sys.exit(main())
