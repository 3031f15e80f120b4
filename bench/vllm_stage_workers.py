"""The worker processes ``bench/vllm_stage.py`` drives over gRPC, and the device as an outside
observer (NVML; ``--smoke``: the simulated GPU) sees it."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from bench.worker_grpc import ack_json, free_port
from omnistage.worker.v1 import (
    inference_service_pb2,
    inference_service_pb2_grpc,
    sleep_service_pb2,
    sleep_service_pb2_grpc,
    types_pb2,
)
from omnistage_worker.runners.vllm_wake import MARKER

Json = dict[str, Any]
REPO = Path(__file__).resolve().parent.parent
STANDIN = REPO / "tests" / "fakevllm"


class Outside:
    """The device as nvidia-smi shows it (smoke: the simulated GPU's snapshot)."""

    def __init__(self, fake_dir: Path | None) -> None:
        self.fake_dir = fake_dir
        self._handle: Any = None
        if fake_dir is None:
            import pynvml

            pynvml.nvmlInit()
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
            if visible.startswith(("GPU-", "MIG-")):
                self._handle = pynvml.nvmlDeviceGetHandleByUUID(visible)
            else:
                self._handle = pynvml.nvmlDeviceGetHandleByIndex(int(visible or 0))

    def read(self) -> Json:
        if self.fake_dir is not None:
            from tests.fakegpu.device import FakeGpu

            snap = FakeGpu(self.fake_dir).snapshot()
            used = snap.device.reserve + snap.used_total
            return {"total": snap.device.total, "used": used, "free": snap.free}
        import pynvml

        info = pynvml.nvmlDeviceGetMemoryInfo(self._handle)
        return {"total": int(info.total), "used": int(info.used), "free": int(info.free)}


class PhaseLog:
    """The fast sleep/wake's phase lines (``runners/vllm_wake``) that vLLM's engine writes into
    the worker's log: each :meth:`take` returns those written since the last one."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def take(self) -> list[Json]:
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # whole lines only
        self.offset += end
        out: list[Json] = []
        for line in data[:end].decode(errors="replace").splitlines():
            at = line.find(MARKER)
            if at >= 0:
                with contextlib.suppress(ValueError):
                    out.append(json.loads(line[at + len(MARKER) :].strip()))
        return out


# ---- workers --------------------------------------------------------------------------------


@dataclass
class Worker:
    name: str
    proc: subprocess.Popen[bytes]
    channel: grpc.Channel
    spawned_at: float

    @property
    def sleep_stub(self) -> sleep_service_pb2_grpc.SleepServiceStub:
        return sleep_service_pb2_grpc.SleepServiceStub(self.channel)

    def status(self) -> sleep_service_pb2.GetStatusResponse:
        reply: sleep_service_pb2.GetStatusResponse = self.sleep_stub.GetStatus(
            sleep_service_pb2.GetStatusRequest(), timeout=30
        )
        return reply

    def generate(self, prompt: str, tokens: int) -> list[int]:
        stub = inference_service_pb2_grpc.InferenceServiceStub(self.channel)
        request = inference_service_pb2.GenerateRequest(
            request_id=str(uuid.uuid4()), prompt=prompt, max_new_tokens=tokens
        )
        return list(stub.Generate(request, timeout=600).text.token_ids)

    def sleep(self, level: int) -> Json:
        request = sleep_service_pb2.SleepRequest(
            task_id=str(uuid.uuid4()), level=types_pb2.SleepLevel.ValueType(level)
        )
        start = time.perf_counter()
        reply = self.sleep_stub.Sleep(request, timeout=600)
        return ack_json(reply.ack, time.perf_counter() - start)

    def wake(self) -> Json:
        request = sleep_service_pb2.WakeUpRequest(task_id=str(uuid.uuid4()))
        start = time.perf_counter()
        reply = self.sleep_stub.WakeUp(request, timeout=600)
        return ack_json(reply.ack, time.perf_counter() - start)

    def stop(self) -> None:
        from tests.cluster.procs import terminate

        self.channel.close()
        terminate(self.proc, grace=120)


def worker_env(smoke: bool, fake_dir: Path | None, extra: dict[str, str]) -> dict[str, str]:
    env = {**os.environ, **extra}
    paths = [str(REPO / "worker_image/src"), str(REPO / "protos/gen/python"), str(REPO)]
    if smoke:
        paths.insert(0, str(STANDIN))
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")])
    if fake_dir is not None:
        env["OMNISTAGE_MEMORY_PROBE"] = "tests.fakegpu.probe:from_env"
        env["OMNISTAGE_FAKE_GPU"] = str(fake_dir)
        env["OMNISTAGE_CPU_THREADS"] = "1"
    return env


def start_worker(
    name: str, args: list[str], env: dict[str, str], log: Path, *, ready: str, timeout: float
) -> Worker:
    """Spawn ``omnistage-worker``; return once ``ready`` is SERVING on grpc.health.v1."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    port = free_port()
    cmd = [sys.executable, "-m", "omnistage_worker", "--host=127.0.0.1", f"--port={port}", *args]
    spawned = time.time()
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{name} worker exited with {proc.returncode}:\n{tail}")
        try:
            reply = health.Check(health_pb2.HealthCheckRequest(service=ready), timeout=2)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return Worker(name, proc, channel, spawned)
        except grpc.RpcError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError(f"{name} worker did not become healthy in {timeout}s")
        time.sleep(0.1)


def wait_state(worker: Worker, state: types_pb2.WorkerState.ValueType, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while worker.status().state != state:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{worker.name} never reached {types_pb2.WorkerState.Name(state)}")
        time.sleep(0.1)
