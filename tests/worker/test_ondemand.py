"""OnDemand workers hold requests while asleep, stream their demand, and serve in order."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest

from omnistage.worker.v1 import (
    demand_service_pb2,
    demand_service_pb2_grpc,
    inference_service_pb2,
    types_pb2,
)
from tests.worker.conftest import StartWorker, WorkerHandle, rpc_error, wait_for

ACTIVE = types_pb2.WORKER_STATE_ACTIVE


async def on_demand(start_worker: StartWorker, lm_dir: Path, **overrides: Any) -> WorkerHandle:
    overrides.setdefault("activation", "ondemand")
    overrides.setdefault("initial_state", "asleep")
    return await start_worker(lm_dir, "ar", "transformers", **overrides)


class DemandWatch:
    """The operator's side of WatchDemand: the latest message, read in the background."""

    def __init__(self, worker: WorkerHandle) -> None:
        stub = demand_service_pb2_grpc.DemandServiceStub(worker.channel)
        self.call = stub.WatchDemand(
            demand_service_pb2.WatchDemandRequest(), metadata=worker.metadata
        )
        self.latest: demand_service_pb2.WatchDemandResponse | None = None
        self.messages = 0
        self.task = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        async for message in self.call:
            self.latest = message
            self.messages += 1

    async def until(self, what: str, test: Any) -> demand_service_pb2.WatchDemandResponse:
        async def reached() -> bool:
            return self.latest is not None and bool(test(self.latest))

        await wait_for(reached, within=30, what=what)
        assert self.latest is not None
        return self.latest

    def close(self) -> None:
        self.call.cancel()


async def test_held_requests_are_streamed_and_served_in_arrival_order(
    start_worker: StartWorker, lm_dir: Path
) -> None:
    # One request at a time (--max-batch 1), so the order they finish in is the order the
    # wake released them in (batched, they would finish together, in any order).
    worker = await on_demand(start_worker, lm_dir, max_batch=1)
    watch = DemandWatch(worker)
    try:
        first = await watch.until("the first message", lambda m: True)
        assert first.held_requests == 0
        assert first.policy == demand_service_pb2.ACTIVATION_POLICY_ON_DEMAND
        assert not first.HasField("oldest_hold_start")
        finished: list[str] = []

        async def call(rid: str) -> inference_service_pb2.GenerateResponse:
            response = await worker.generate(request_id=rid, max_new_tokens=2)
            finished.append(response.request_id)
            return response

        calls = []
        for n in range(3):
            calls.append(asyncio.ensure_future(call(f"r{n}")))
            await watch.until(f"{n + 1} held", lambda m, n=n: m.held_requests == n + 1)
        held = await watch.until("3 held", lambda m: m.held_requests == 3)
        assert held.HasField("oldest_hold_start") and held.HasField("last_request_time")
        assert not any(c.done() for c in calls)
        ack = await worker.wake()
        assert ack.ok
        await asyncio.gather(*calls)
        assert finished == ["r0", "r1", "r2"]
        done = await watch.until("served", lambda m: m.served_after_hold_total == 3)
        assert done.held_requests == 0 and done.state == ACTIVE
        assert done.hold_seconds_total > 0
    finally:
        watch.close()


async def test_a_request_past_its_hold_timeout_is_unavailable_with_retry_after(
    start_worker: StartWorker, lm_dir: Path
) -> None:
    worker = await on_demand(start_worker, lm_dir, hold_timeout_s=0.3)
    watch = DemandWatch(worker)
    try:
        call = worker.inference_stub.Generate(
            inference_service_pb2.GenerateRequest(prompt="hi", max_new_tokens=1)
        )
        error = await rpc_error(call)
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert "hold timeout of 0.3s" in (error.details() or "")
        assert ("retry-after", "1") in tuple(error.trailing_metadata() or ())
        seen = await watch.until("a timeout", lambda m: m.hold_timeouts_total == 1)
        assert seen.held_requests == 0
    finally:
        watch.close()


async def test_a_full_hold_queue_refuses_at_once(start_worker: StartWorker, lm_dir: Path) -> None:
    worker = await on_demand(start_worker, lm_dir, max_held=1)
    held = asyncio.ensure_future(worker.generate(max_new_tokens=1))
    await wait_for(_held(worker, 1), what="one held request")
    error = await rpc_error(worker.generate(max_new_tokens=1))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "hold queue full" in (error.details() or "")
    await worker.wake()
    assert (await held).text.token_ids


async def test_a_manual_worker_still_refuses_while_asleep(
    start_worker: StartWorker, lm_dir: Path
) -> None:
    worker = await on_demand(start_worker, lm_dir, activation="manual")
    error = await rpc_error(worker.generate(max_new_tokens=1))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert worker.server.worker.demand.held == 0


async def test_a_sleep_holds_new_requests_and_the_next_wake_serves_them(
    start_worker: StartWorker, lm_dir: Path
) -> None:
    worker = await on_demand(start_worker, lm_dir, initial_state="active")
    assert (await worker.sleep(1)).ok
    call = asyncio.ensure_future(worker.generate(max_new_tokens=1))
    await wait_for(_held(worker, 1), what="the request held")
    assert (await worker.wake()).ok
    assert (await call).text.token_ids


async def test_generate_stream_sends_chunks_then_the_complete_response(
    lm_worker: WorkerHandle,
) -> None:
    request = inference_service_pb2.GenerateRequest(request_id="s", prompt="a b", max_new_tokens=5)
    messages = [
        m
        async for m in lm_worker.inference_stub.GenerateStream(
            inference_service_pb2.GenerateStreamRequest(request=request)
        )
    ]
    chunks = [m.chunk for m in messages if m.WhichOneof("event") == "chunk"]
    assert messages[-1].WhichOneof("event") == "done"
    done = messages[-1].done
    assert [t for c in chunks for t in c.token_ids] == list(done.text.token_ids)
    assert "".join(c.text for c in chunks) == done.text.text
    assert len(chunks) >= len(done.text.token_ids)  # one per token (and a tail, if any)
    plain = await lm_worker.generate(prompt="a b", max_new_tokens=5)
    assert list(plain.text.token_ids) == list(done.text.token_ids)


async def test_demand_service_needs_the_token(
    start_worker: StartWorker, lm_dir: Path, tmp_path: Path
) -> None:
    worker = await on_demand(start_worker, lm_dir, token="s3cret")
    stub = demand_service_pb2_grpc.DemandServiceStub(worker.channel)
    call = stub.WatchDemand(demand_service_pb2.WatchDemandRequest())
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in call:
            pass
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    watch = DemandWatch(worker)
    try:
        assert (await watch.until("a message", lambda m: True)).state
    finally:
        watch.close()


def _held(worker: WorkerHandle, count: int) -> Any:
    async def held() -> bool:
        return worker.server.worker.demand.held == count

    return held
