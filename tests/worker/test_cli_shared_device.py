"""Real ``omnistage-worker`` processes: two share one simulated GPU (a wake that does not fit is
refused), and SIGTERM drains the request in flight."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from omnistage.worker.v1 import types_pb2
from tests.fakegpu.device import FakeGpu
from tests.fakegpu.model import Device
from tests.worker.cli_process import Subprocess, spawn
from tests.worker.conftest import StartWorker, WorkerHandle, wait_for

__all__ = ["spawn"]  # the fixture, used here

FAKE_GPU_PROBE = "tests.fakegpu.probe:from_env"


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
