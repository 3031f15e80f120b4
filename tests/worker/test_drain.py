"""A sleep's drain: timed apart from the transition, bounded per request, refused cleanly."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from omnistage.worker.v1 import inference_service_pb2, sleep_service_pb2, types_pb2
from tests.worker.conftest import StartWorker, WorkerHandle, rpc_error, wait_for
from tests.worker.doubles import HeldMemoryLM

ACTIVE = types_pb2.WORKER_STATE_ACTIVE
SLEEPING = types_pb2.WORKER_STATE_SLEEPING


@pytest.fixture
async def held(start_worker: StartWorker, lm_dir: Path) -> AsyncIterator[WorkerHandle]:
    """A worker whose requests wait for the test to release them."""
    worker = await start_worker(lm_dir, "ar", "transformers", runner_factory=HeldMemoryLM)
    runner = worker.server.worker.runner
    assert isinstance(runner, HeldMemoryLM)
    runner.hold = threading.Event()
    yield worker
    runner.hold.set()  # never leave a request blocked behind the test


def runner_of(worker: WorkerHandle) -> HeldMemoryLM:
    runner = worker.server.worker.runner
    assert isinstance(runner, HeldMemoryLM) and runner.hold is not None
    return runner


async def until_state(worker: WorkerHandle, state: int, what: str) -> None:
    async def reached() -> bool:
        return (await worker.status()).state == state

    await wait_for(reached, what=what)


async def start_held_request(
    worker: WorkerHandle,
) -> asyncio.Future[inference_service_pb2.GenerateResponse]:
    call = asyncio.ensure_future(worker.generate(max_new_tokens=2))

    async def inflight() -> bool:
        return (await worker.status()).inflight_requests == 1

    await wait_for(inflight, what="the request to start")
    return call


async def test_ack_times_drain_and_transition_apart(held: WorkerHandle) -> None:
    runner = runner_of(held)
    request = await start_held_request(held)
    sleep = asyncio.ensure_future(held.sleep(1, task_id="drained"))
    await until_state(held, SLEEPING, "the sleep to wait for the request")
    # Several round trips pass while the request is held: all of it is drain, not sleep.
    for _ in range(5):
        assert (await held.status()).state == SLEEPING
    assert runner.hold is not None
    runner.hold.set()
    await request
    ack = await sleep
    assert ack.ok, ack.error

    ended = int(runner.generate_ended_at * 1e9)
    drain_start = ack.drain_started_at.ToNanoseconds()
    drain = ack.drain_duration.ToNanoseconds()
    start, finish = ack.started_at.ToNanoseconds(), ack.finished_at.ToNanoseconds()
    assert ack.HasField("drain_started_at") and ack.HasField("drain_duration")
    assert drain_start < ended <= start  # the transition began after the request ended
    assert drain_start + drain >= ended  # the drain covers the wait for it
    assert abs(drain_start + drain - start) < 5_000_000  # and the transition follows it
    assert abs(ack.duration.ToNanoseconds() - (finish - start)) < 5_000_000
    assert ack.duration.ToNanoseconds() < finish - drain_start  # the wait is not in duration


async def test_sleep_without_requests_has_no_drain(lm_worker: WorkerHandle) -> None:
    ack = await lm_worker.sleep(1)
    assert ack.ok
    assert not ack.HasField("drain_started_at") and not ack.HasField("drain_duration")


async def test_drain_timeout_per_request(held: WorkerHandle) -> None:
    runner = runner_of(held)
    status = await held.status()
    assert status.drain_timeout.ToSeconds() == 600  # the worker's own bound (--drain-timeout)
    before = status.used_bytes
    request = await start_held_request(held)

    refused = await asyncio.wait_for(held.sleep(1, task_id="short", drain_timeout=0.3), 20)
    assert not refused.ok
    assert refused.error == (
        "in-flight requests (1) did not finish within the drain timeout of 0.3s; "
        "the sleep was not started"
    )
    assert refused.state == ACTIVE and refused.level == types_pb2.SLEEP_LEVEL_UNSPECIFIED
    assert refused.drain_duration.ToNanoseconds() >= 300_000_000
    assert refused.used_after_bytes == refused.used_before_bytes == before
    status = await held.status()
    assert status.state == ACTIVE and status.error == ""
    assert status.inflight_requests == 1  # the request was never cut short

    assert runner.hold is not None
    runner.hold.set()
    assert (await request).text.token_ids
    # The not-ok Ack is final for its task id; the operator retries under a new one.
    again = await held.sleep(1, task_id="short", drain_timeout=0.3)
    assert again.replayed and not again.ok
    assert (await held.status()).state == ACTIVE
    retry = await held.sleep(1, task_id="retry", drain_timeout=0.3)
    assert retry.ok and retry.state == types_pb2.WORKER_STATE_ASLEEP


async def test_worker_drain_timeout_applies_when_the_request_sets_none(
    start_worker: StartWorker, lm_dir: Path
) -> None:
    worker = await start_worker(
        lm_dir, "ar", "transformers", runner_factory=HeldMemoryLM, drain_timeout_s=0.2
    )
    runner = worker.server.worker.runner
    assert isinstance(runner, HeldMemoryLM)
    runner.hold = threading.Event()
    try:
        assert (await worker.status()).drain_timeout.ToMilliseconds() == 200
        await start_held_request(worker)
        ack = await asyncio.wait_for(worker.sleep(1), 20)
        assert not ack.ok and "drain timeout of 0.2s" in ack.error
    finally:
        runner.hold.set()


async def test_negative_drain_timeout_is_invalid(lm_worker: WorkerHandle) -> None:
    request = sleep_service_pb2.SleepRequest(task_id="t", level=1)  # type: ignore[arg-type]
    request.drain_timeout.FromSeconds(-1)
    err = await rpc_error(lm_worker.sleep_stub.Sleep(request))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.details() or "").startswith("drain_timeout:")
    assert (await lm_worker.status()).state == ACTIVE
