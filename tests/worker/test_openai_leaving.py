"""Requests that leave: a client that goes while held or queued, and a worker that goes.

A client that disconnects while its request is held (OnDemand, asleep) or queued behind a
running one leaves the queue: the worker's demand drops and the model never runs it. A worker
that shuts down answers its held and queued requests (503 + Retry-After +
``x-omnistage-unserved``; gRPC UNAVAILABLE + ``retry-after``) and lets the running one finish.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace
from pathlib import Path

import grpc
import httpx

from omnistage.worker.v1 import demand_service_pb2, demand_service_pb2_grpc, inference_service_pb2
from omnistage_worker.config import WorkerConfig
from omnistage_worker.control.queued import UNSERVED_HEADER
from omnistage_worker.runners.base import TextChunkSink
from omnistage_worker.runners.causal_lm import CausalLMRunner
from tests.worker.conftest import StartWorker, WorkerHandle, rpc_error, wait_for


class GatedLM(CausalLMRunner):
    """The tiny causal LM taking one request at a time (``--max-batch 1``: the next ones
    queue for the model); each generation waits for the gate first, and is counted."""

    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(replace(config, max_batch=1))
        self.gate = threading.Event()
        self.started = 0

    def generate(
        self,
        request: inference_service_pb2.GenerateRequest,
        sink: TextChunkSink | None = None,
    ) -> inference_service_pb2.GenerateResponse:
        self.started += 1
        self.gate.wait(60)
        return super().generate(request, sink)


def http(worker: WorkerHandle) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=f"http://127.0.0.1:{worker.server.http_port}", timeout=60)


BODY = {"prompt": "the cat", "max_tokens": 2}


async def test_a_client_that_goes_while_held_leaves_the_hold_queue(
    start_worker: StartWorker, lm_dir: Path
) -> None:
    worker = await start_worker(
        lm_dir, "ar", "transformers", http_port=0, activation="ondemand", initial_state="asleep"
    )
    demand = worker.server.worker.demand
    async with http(worker) as client:
        stays = asyncio.ensure_future(client.post("/v1/completions", json=BODY))
        goes = asyncio.ensure_future(client.post("/v1/completions", json={**BODY, "stream": True}))

        async def two_held() -> bool:
            return demand.held == 2

        await wait_for(two_held, what="both requests held")
        goes.cancel()  # the client closes its connection

        async def one_held() -> bool:
            return demand.held == 1

        await wait_for(one_held, what="the gone client's request to leave the hold queue")
        figures = demand.figures()
        assert figures.held == 1 and figures.hold_timeouts_total == 0
        # what the operator reads: the worker's DemandService stream says 1 held, not 2
        stream = demand_service_pb2_grpc.DemandServiceStub(worker.channel).WatchDemand(
            demand_service_pb2.WatchDemandRequest()
        )
        reported = await asyncio.wait_for(stream.read(), 10)
        stream.cancel()
        assert reported.held_requests == 1
        assert (await worker.wake()).ok
        assert (await stays).status_code == 200
    assert demand.figures().served_after_hold_total == 1  # the gone one was never served


async def test_a_client_that_goes_while_queued_is_never_run(
    start_worker: StartWorker, lm_dir: Path
) -> None:
    worker = await start_worker(lm_dir, "ar", "transformers", http_port=0, runner_factory=GatedLM)
    runner = worker.server.worker.runner
    assert isinstance(runner, GatedLM)
    queued = worker.server.worker.queued
    async with http(worker) as client:
        running = asyncio.ensure_future(client.post("/v1/completions", json=BODY))

        async def started() -> bool:
            return runner.started == 1

        await wait_for(started, what="the first request on the model")
        goes = asyncio.ensure_future(client.post("/v1/completions", json=BODY))

        async def one_queued() -> bool:
            return len(queued) == 1

        await wait_for(one_queued, what="the second request queued")
        goes.cancel()

        async def none_queued() -> bool:
            return len(queued) == 0

        await wait_for(none_queued, what="the gone client's request to leave the queue")
        runner.gate.set()
        assert (await running).status_code == 200
        after = await client.post("/v1/completions", json=BODY)
        assert after.status_code == 200
    assert runner.started == 2  # the first and the last: the gone one never ran


async def test_shutdown_answers_held_and_queued_and_finishes_the_running(
    start_worker: StartWorker, lm_dir: Path
) -> None:
    active = await start_worker(lm_dir, "ar", "transformers", http_port=0, runner_factory=GatedLM)
    lazy = await start_worker(
        lm_dir, "ar", "transformers", http_port=0, activation="ondemand", initial_state="asleep"
    )
    runner = active.server.worker.runner
    assert isinstance(runner, GatedLM)
    async with http(active) as client, http(lazy) as lazy_client:
        running = asyncio.ensure_future(client.post("/v1/completions", json=BODY))

        async def started() -> bool:
            return runner.started == 1

        await wait_for(started, what="a request on the model")
        queued = [
            asyncio.ensure_future(client.post("/v1/completions", json={**BODY, "stream": s}))
            for s in (False, True)
        ]
        grpc_queued = asyncio.ensure_future(active.generate(prompt="the cat", max_new_tokens=2))

        async def three_queued() -> bool:
            return len(active.server.worker.queued) == 3

        await wait_for(three_queued, what="three requests queued")
        held = asyncio.ensure_future(lazy_client.post("/v1/completions", json=BODY))
        grpc_held = asyncio.ensure_future(lazy.generate(prompt="the cat"))

        async def two_held() -> bool:
            return lazy.server.worker.demand.held == 2

        await wait_for(two_held, what="two requests held")

        stopping = asyncio.ensure_future(active.server.stop(30.0))
        for answer in await asyncio.gather(*queued):
            assert answer.status_code == 503, answer.text
            assert answer.headers["retry-after"] == "1"
            assert answer.headers[UNSERVED_HEADER] == "shutting-down"
            assert answer.json()["error"]["code"] == "worker_shutting_down"
        error = await rpc_error(grpc_queued)
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert ("retry-after", "1") in tuple(error.trailing_metadata() or ())
        assert not stopping.done()  # the running request holds the shutdown (within grace)
        runner.gate.set()
        assert (await running).status_code == 200
        await asyncio.wait_for(stopping, 30)
        assert runner.started == 1  # the queued ones never reached the model

        lazy_stop = asyncio.ensure_future(lazy.server.stop(30.0))
        answer = await held
        assert answer.status_code == 503 and answer.headers[UNSERVED_HEADER] == "shutting-down"
        error = await rpc_error(grpc_held)
        assert error.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in (
            error.details() or ""
        )
        await asyncio.wait_for(lazy_stop, 10)
