"""Leadership epochs over real gRPC: an order from an older epoch is refused and changes nothing."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import grpc

from omnistage.worker.v1 import sleep_service_pb2, types_pb2
from tests.worker.conftest import StartWorker, WorkerHandle, rpc_error, wait_for
from tests.worker.doubles import HeldMemoryLM

ACTIVE = types_pb2.WORKER_STATE_ACTIVE
ASLEEP = types_pb2.WORKER_STATE_ASLEEP


async def test_older_epoch_is_refused_and_changes_nothing(lm_worker: WorkerHandle) -> None:
    assert (await lm_worker.status()).epoch == 0
    slept = await lm_worker.sleep(1, task_id="s5", epoch=5)
    assert slept.ok and slept.epoch == 5
    assert (await lm_worker.status()).epoch == 5

    err = await rpc_error(lm_worker.wake(task_id="w3", epoch=3))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.details() == "order from epoch 3 refused: this worker has obeyed epoch 5"
    err = await rpc_error(lm_worker.sleep(2, task_id="d3", epoch=3))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    status = await lm_worker.status()
    assert status.state == ASLEEP and status.level == types_pb2.SLEEP_LEVEL_OFFLOAD
    assert status.epoch == 5 and status.last_ack.task_id == "s5"

    # The refused ids were not remembered: the current leader may use them.
    woke = await lm_worker.wake(task_id="w3", epoch=5)
    assert woke.ok and not woke.replayed and woke.epoch == 5 and woke.state == ACTIVE

    # Once an elected leader was obeyed, epoch 0 (no election) is refused too: an operator
    # without election cannot order around the fence.
    err = await rpc_error(lm_worker.sleep(1, task_id="zero", epoch=0))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.details() == (
        "order from epoch 0 (no leader election) refused: this worker has obeyed epoch 5"
    )
    assert (await lm_worker.status()).state == ACTIVE
    assert (await lm_worker.status()).epoch == 5
    newer = await lm_worker.sleep(1, epoch=7)
    assert newer.ok and newer.epoch == 7
    assert (await lm_worker.status()).epoch == 7


async def test_epoch_0_is_obeyed_while_no_epoch_was(lm_worker: WorkerHandle) -> None:
    """Without election (epoch 0 everywhere) the worker obeys as before."""
    assert (await lm_worker.sleep(1, epoch=0)).ok
    assert (await lm_worker.wake(epoch=0)).ok
    assert (await lm_worker.status()).epoch == 0


async def test_a_new_pod_knows_the_groups_epoch_before_any_order(
    start_worker: StartWorker, lm_dir: Path
) -> None:
    """``--epoch`` (the operator writes its epoch into the pod): the first order already has
    to be from that epoch or newer; epoch 0 and an older leader are refused."""
    worker = await start_worker(lm_dir, "ar", "transformers", epoch=4)
    assert (await worker.status()).epoch == 4
    for stale in (0, 3):
        err = await rpc_error(worker.sleep(1, epoch=stale))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "obeyed epoch 4" in (err.details() or "")
    assert (await worker.status()).state == ACTIVE
    slept = await worker.sleep(1, epoch=4)
    assert slept.ok and slept.epoch == 4


async def test_stale_leader_cannot_replay_a_task_id(lm_worker: WorkerHandle) -> None:
    first = await lm_worker.sleep(1, task_id="t1", epoch=4)
    assert first.ok
    assert (await lm_worker.wake(task_id="t2", epoch=6)).ok
    err = await rpc_error(lm_worker.sleep(1, task_id="t1", epoch=4))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "epoch 4 refused" in (err.details() or "") and "epoch 6" in (err.details() or "")
    assert (await lm_worker.status()).state == ACTIVE
    # The current leader repeating the id gets the first Ack back (idempotence), nothing more.
    again = await lm_worker.sleep(1, task_id="t1", epoch=6)
    assert again.replayed and again.epoch == 4
    assert (await lm_worker.status()).state == ACTIVE


async def test_a_reader_epoch_fences_the_leader_it_replaced(lm_worker: WorkerHandle) -> None:
    """A new leader reads every worker's status before it orders anything: from that read on,
    the replaced leader's orders are refused even here, where the new one has ordered nothing."""
    assert (await lm_worker.sleep(1, task_id="old", epoch=2)).ok
    read = await lm_worker.sleep_stub.GetStatus(sleep_service_pb2.GetStatusRequest(epoch=3))
    assert read.epoch == 3 and read.state == ASLEEP
    err = await rpc_error(lm_worker.wake(task_id="stale", epoch=2))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.details() == "order from epoch 2 refused: this worker has obeyed epoch 3"
    assert (await lm_worker.status()).state == ASLEEP
    # A read never lowers the epoch and is never refused, whatever epoch it carries.
    older = await lm_worker.sleep_stub.GetStatus(sleep_service_pb2.GetStatusRequest(epoch=1))
    assert older.epoch == 3
    err = await rpc_error(
        lm_worker.sleep_stub.GetStatus(sleep_service_pb2.GetStatusRequest(epoch=-1))
    )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_negative_epoch_is_invalid(lm_worker: WorkerHandle) -> None:
    err = await rpc_error(
        lm_worker.sleep_stub.Sleep(
            sleep_service_pb2.SleepRequest(task_id="t", level=1, epoch=-1)  # type: ignore[arg-type]
        )
    )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.details() or "").startswith("epoch:")


async def test_newer_leader_obeyed_while_draining_refuses_the_old_one(
    start_worker: StartWorker, lm_dir: Path
) -> None:
    """A sleep of epoch 5 that waits for a request already fences epoch 3's orders."""
    worker = await start_worker(lm_dir, "ar", "transformers", runner_factory=HeldMemoryLM)
    runner = worker.server.worker.runner
    assert isinstance(runner, HeldMemoryLM)
    runner.hold = threading.Event()
    try:
        request = asyncio.ensure_future(worker.generate(max_new_tokens=2))

        async def inflight() -> bool:
            return (await worker.status()).inflight_requests == 1

        await wait_for(inflight, what="the request to start")
        sleep = asyncio.ensure_future(worker.sleep(1, epoch=5))

        async def sleeping() -> bool:
            return (await worker.status()).state == types_pb2.WORKER_STATE_SLEEPING

        await wait_for(sleeping, what="the sleep to wait for the request")
        err = await rpc_error(worker.wake(epoch=3))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert not sleep.done()
    finally:
        runner.hold.set()  # never leave a request blocked behind the test
    assert (await request).text.token_ids
    ack = await sleep
    assert ack.ok and ack.epoch == 5 and ack.state == ASLEEP
