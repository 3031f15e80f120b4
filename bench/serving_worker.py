"""The real ``omnistage-worker`` process ``bench/serving.py`` (and ``bench/serving_cpu.py``)
drives: started until Active, its start-up work waited out, stopped."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from bench.serving_plan import Json, Plan
from bench.worker_grpc import free_port
from omnistage.worker.v1 import (
    inference_service_pb2_grpc,
    sleep_service_pb2,
    sleep_service_pb2_grpc,
    types_pb2,
)

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Worker:
    proc: subprocess.Popen[bytes]
    channel: grpc.Channel
    http_port: int
    log_path: Path

    @property
    def sleep(self) -> Any:
        return sleep_service_pb2_grpc.SleepServiceStub(self.channel)

    @property
    def inference(self) -> Any:
        return inference_service_pb2_grpc.InferenceServiceStub(self.channel)

    def status(self) -> Any:
        return self.sleep.GetStatus(sleep_service_pb2.GetStatusRequest(), timeout=30)

    def stop(self) -> None:
        self.channel.close()
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def start_worker(runner: str, backend: str, model: Path, plan: Plan, *, max_batch: int,
                 log_path: Path, launcher: list[str] | None = None) -> Worker:  # fmt: skip
    """Spawn ``python -m omnistage_worker`` (or ``launcher`` + the worker's flags); return
    once it is Active."""
    port, http_port = free_port(), free_port()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO / "worker_image/src"), str(REPO / "protos/gen/python"), env.get("PYTHONPATH", "")]
    )
    dtype = plan.dtype if runner == "ar" or plan.device == "cpu" else "float16"
    cmd = [
        *(launcher or [sys.executable, "-m", "omnistage_worker"]),
        f"--runner={runner}", f"--backend={backend}", f"--model={model}",
        f"--device={plan.device}", f"--dtype={dtype}", "--host=127.0.0.1",
        f"--port={port}", f"--http-port={http_port}", "--served-model-name=bench",
        f"--max-batch={max_batch}", "--activation=ondemand", "--hold-timeout=120",
    ]  # fmt: skip
    if plan.device == "cpu":
        cmd.append("--cpu-threads=1")  # a loaded small CPU: no oversubscribed thread pools
    log = log_path.open("wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    worker = Worker(proc, grpc.insecure_channel(f"127.0.0.1:{port}"), http_port, log_path)
    deadline = time.monotonic() + 900
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"worker exited with {proc.returncode}: {tail(log_path)}")
        try:
            if worker.status().state == types_pb2.WORKER_STATE_ACTIVE:
                return worker
        except grpc.RpcError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"worker did not become Active: {tail(log_path)}")
        time.sleep(0.2)


PINNED = "page-locked in"
"""The worker's log line once its host copy is page-locked (engine/pinning.py, in the
background after Active, stepping aside for requests; about 4.3 s on an idle H200)."""


def settle(log_path: Path, within: float) -> Json:
    """Wait (at most ``within`` s) for the worker's start-up work in the background to end,
    so the client windows measure steady serving, not the start: what was waited is kept."""
    began = time.monotonic()
    while PINNED not in log_path.read_text(errors="replace"):
        if time.monotonic() - began > within:
            return {"host_copy_pinned": False, "waited_s": time.monotonic() - began}
        time.sleep(0.1)
    return {"host_copy_pinned": True, "waited_s": time.monotonic() - began}


def tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
