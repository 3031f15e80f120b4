"""In-flight requests finish before a sleep; repeated task ids replay; transitions serialize."""

from __future__ import annotations

import asyncio
import itertools

import grpc
import pytest

from omnistage.worker.v1 import types_pb2
from tests.worker.conftest import WorkerHandle, wait_for

LONG_STEPS = 120  # about a second of denoising on the tiny pipeline


async def test_inflight_generate_finishes_before_sleep(sd_worker: WorkerHandle) -> None:
    reference = await sd_worker.generate(prompt="a cat", seed=3, num_inference_steps=LONG_STEPS)
    long_call = asyncio.ensure_future(
        sd_worker.generate(prompt="a cat", seed=3, num_inference_steps=LONG_STEPS)
    )

    async def inflight() -> bool:
        return (await sd_worker.status()).inflight_requests == 1

    await wait_for(inflight, what="the long request to start")
    sleep_call = asyncio.ensure_future(sd_worker.sleep(1, task_id="sleep-during-generate"))

    async def sleeping() -> bool:
        return (await sd_worker.status()).state == types_pb2.WORKER_STATE_SLEEPING

    await wait_for(sleeping, what="the sleep to start waiting")
    # New requests are refused with the reason while the sleep waits; none is lost.
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await sd_worker.generate(prompt="late", num_inference_steps=1)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert info.value.details() == "worker is sleeping"
    assert not long_call.done()

    result = await long_call
    ack = await sleep_call
    assert result.image.png == reference.image.png  # the in-flight request ran to its end
    assert ack.ok and ack.state == types_pb2.WORKER_STATE_ASLEEP
    assert ack.freed_bytes > 0
    assert result.duration.ToNanoseconds() > 0


async def test_repeated_task_id_replays_without_second_transition(
    lm_worker: WorkerHandle,
) -> None:
    first = await lm_worker.sleep(1, task_id="op-1")
    assert first.ok and not first.replayed
    woke = await lm_worker.wake(task_id="op-2")
    assert woke.ok
    again = await lm_worker.sleep(1, task_id="op-1")
    assert again.replayed
    expected = types_pb2.Ack()
    expected.CopyFrom(first)
    expected.replayed = True
    assert again == expected  # the very same figures and timestamps
    status = await lm_worker.status()
    assert status.state == types_pb2.WORKER_STATE_ACTIVE  # no second sleep happened
    assert status.last_ack.task_id == "op-2"


async def test_concurrent_duplicates_join_one_transition(lm_worker: WorkerHandle) -> None:
    acks = await asyncio.gather(*(lm_worker.sleep(2, task_id="dup") for _ in range(4)))
    assert sum(not a.replayed for a in acks) == 1
    assert len({a.started_at.ToNanoseconds() for a in acks}) == 1
    assert all(a.ok and a.freed_bytes == acks[0].freed_bytes for a in acks)


async def test_transitions_are_serialized(lm_worker: WorkerHandle) -> None:
    calls = [lm_worker.sleep(1), lm_worker.wake(), lm_worker.sleep(2), lm_worker.wake()]
    acks = await asyncio.gather(*calls)
    assert all(a.ok for a in acks)
    spans = sorted((a.started_at.ToNanoseconds(), a.finished_at.ToNanoseconds()) for a in acks)
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert start >= end  # no two transitions overlapped
    # Whatever the order, the figures chain: each one starts where the previous ended.
    ordered = sorted(acks, key=lambda a: a.started_at.ToNanoseconds())
    for prev, nxt in itertools.pairwise(ordered):
        assert nxt.used_before_bytes == prev.used_after_bytes


async def test_ack_cache_is_bounded() -> None:
    from omnistage_worker.control.acks import AckCache

    cache = AckCache(capacity=3)
    loop = asyncio.get_running_loop()
    for i in range(5):
        cache.put(f"t{i}", "k", loop.create_future())
    assert len(cache) == 3
    assert cache.get("t0", "k") is None and cache.get("t4", "k") is not None
