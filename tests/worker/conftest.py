"""Fixtures for the worker tests: tiny real models, in-process workers over real gRPC."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from omnistage.worker.v1 import (
    inference_service_pb2,
    inference_service_pb2_grpc,
    sleep_service_pb2,
    sleep_service_pb2_grpc,
    types_pb2,
)
from omnistage_worker.config import WorkerConfig
from omnistage_worker.runners.base import ModelRunner
from omnistage_worker.serving.server import WorkerServer
from tests.worker.tiny_models import (
    build_causal_lm,
    build_diffusion_pipeline,
    build_flux_pipeline,
    build_wan_pipeline,
)

LOAD_TIMEOUT_S = 60.0

# One intra-op thread: the CI machine has 2 shared cores, and oversubscribed OpenMP threads
# make the tiny models' timings swing by 20x.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def diffusion_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_diffusion_pipeline(tmp_path_factory.mktemp("models") / "tiny-sd")


@pytest.fixture(scope="session")
def flux_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_flux_pipeline(tmp_path_factory.mktemp("models") / "tiny-flux")


@pytest.fixture(scope="session")
def wan_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_wan_pipeline(tmp_path_factory.mktemp("models") / "tiny-wan")


@pytest.fixture(scope="session")
def lm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_causal_lm(tmp_path_factory.mktemp("models") / "tiny-llama")


@dataclass
class WorkerHandle:
    """A running in-process worker and stubs that talk to it over localhost gRPC."""

    server: WorkerServer
    channel: grpc.aio.Channel
    token: str | None = None
    sleep_stub: Any = field(init=False)
    inference_stub: Any = field(init=False)
    health_stub: Any = field(init=False)

    def __post_init__(self) -> None:
        self.sleep_stub = sleep_service_pb2_grpc.SleepServiceStub(self.channel)
        self.inference_stub = inference_service_pb2_grpc.InferenceServiceStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    async def status(self) -> sleep_service_pb2.GetStatusResponse:
        response: sleep_service_pb2.GetStatusResponse = await self.sleep_stub.GetStatus(
            sleep_service_pb2.GetStatusRequest(), metadata=self.metadata
        )
        return response

    async def sleep(
        self,
        level: int,
        task_id: str | None = None,
        epoch: int = 0,
        drain_timeout: float | None = None,
        components: tuple[str, ...] = (),
    ) -> types_pb2.Ack:
        request = sleep_service_pb2.SleepRequest(
            task_id=task_id or new_task_id(),
            level=level,  # type: ignore[arg-type]
            epoch=epoch,
            components=components,
        )
        if drain_timeout is not None:
            request.drain_timeout.FromNanoseconds(int(drain_timeout * 1e9))
        response = await self.sleep_stub.Sleep(request, metadata=self.metadata)
        ack: types_pb2.Ack = response.ack
        return ack

    async def wake(self, task_id: str | None = None, epoch: int = 0) -> types_pb2.Ack:
        response = await self.sleep_stub.WakeUp(
            sleep_service_pb2.WakeUpRequest(task_id=task_id or new_task_id(), epoch=epoch),
            metadata=self.metadata,
        )
        ack: types_pb2.Ack = response.ack
        return ack

    async def generate(self, **fields: Any) -> inference_service_pb2.GenerateResponse:
        fields.setdefault("prompt", "the cat sat")
        response: inference_service_pb2.GenerateResponse = await self.inference_stub.Generate(
            inference_service_pb2.GenerateRequest(**fields)
        )
        return response

    async def health(self, service: str) -> int:
        response = await self.health_stub.Check(health_pb2.HealthCheckRequest(service=service))
        status: int = response.status
        return status


def new_task_id() -> str:
    return uuid.uuid4().hex


async def rpc_error(call: Awaitable[Any]) -> grpc.aio.AioRpcError:
    """The gRPC error ``call`` fails with (the test fails when it succeeds)."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value


async def wait_for(
    condition: Callable[[], Awaitable[bool]], within: float = 30.0, what: str = "condition"
) -> None:
    """Poll ``condition`` until true, failing after ``within`` seconds."""
    deadline = time.monotonic() + within
    while not await condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within}s waiting for {what}")
        await asyncio.sleep(0.02)


StartWorker = Callable[..., Awaitable[WorkerHandle]]


@pytest.fixture
async def start_worker() -> AsyncIterator[StartWorker]:
    """Start in-process workers on 127.0.0.1:0; all are stopped at the end of the test."""
    handles: list[WorkerHandle] = []

    async def start(model: Path, runner: str, backend: str, **overrides: Any) -> WorkerHandle:
        """``runner_factory`` (config -> runner) replaces the runner for a test double."""
        wait = overrides.pop("wait_loaded", True)
        factory: Callable[[WorkerConfig], ModelRunner] | None = overrides.pop(
            "runner_factory", None
        )
        config = WorkerConfig(
            runner=runner, backend=backend, model=model, host="127.0.0.1", port=0, **overrides
        )
        server = WorkerServer(config, factory(config) if factory is not None else None)
        port = await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        handle = WorkerHandle(server, channel, token=config.token)
        handles.append(handle)
        if wait:
            await asyncio.wait_for(server.wait_loaded(), LOAD_TIMEOUT_S)
        return handle

    yield start
    for handle in handles:
        await handle.channel.close()
        await handle.server.stop(1.0)


@pytest.fixture
async def lm_worker(start_worker: StartWorker, lm_dir: Path) -> WorkerHandle:
    return await start_worker(lm_dir, "ar", "transformers")


@pytest.fixture
async def sd_worker(start_worker: StartWorker, diffusion_dir: Path) -> WorkerHandle:
    return await start_worker(diffusion_dir, "diffusion", "diffusers")
