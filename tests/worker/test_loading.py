"""While the model loads the server already answers: LOADING, and UNAVAILABLE for work."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import grpc
import pytest

from omnistage.worker.v1 import types_pb2
from omnistage_worker.config import WorkerConfig
from omnistage_worker.runners.causal_lm import CausalLMRunner
from omnistage_worker.serving.health import INFERENCE_SERVICE, NOT_SERVING, OVERALL, SERVING
from omnistage_worker.serving.server import WorkerServer
from tests.worker.conftest import WorkerHandle, wait_for


class GatedRunner(CausalLMRunner):
    """The real transformers runner, whose load waits for the test to open a gate."""

    def __init__(self, config: WorkerConfig, gate: threading.Event) -> None:
        super().__init__(config)
        self.gate = gate

    def load(self) -> None:
        assert self.gate.wait(60)
        super().load()


async def test_loading_state(lm_dir: Path) -> None:
    gate = threading.Event()
    config = WorkerConfig(
        runner="ar", backend="transformers", model=lm_dir, host="127.0.0.1", port=0
    )
    server = WorkerServer(config, runner=GatedRunner(config, gate))
    port = await server.start()
    worker = WorkerHandle(server, grpc.aio.insecure_channel(f"127.0.0.1:{port}"))
    try:
        status = await worker.status()
        assert status.state == types_pb2.WORKER_STATE_LOADING
        assert await worker.health(OVERALL) == SERVING
        assert await worker.health(INFERENCE_SERVICE) == NOT_SERVING
        for call in (worker.sleep(1), worker.wake(), worker.generate()):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert info.value.details() == "worker is loading the model"
        gate.set()

        async def active() -> bool:
            return (await worker.status()).state == types_pb2.WORKER_STATE_ACTIVE

        await wait_for(active, what="the load to finish")
        assert await worker.health(INFERENCE_SERVICE) == SERVING
        assert (await worker.sleep(1, task_id="after-load")).ok
    finally:
        gate.set()
        await worker.channel.close()
        await asyncio.wait_for(server.stop(1), 30)
