"""A failed residual check never reads as asleep; the peak while Active is measured and reported."""

from __future__ import annotations

from pathlib import Path

import grpc

from omnistage.worker.v1 import types_pb2
from omnistage_worker.serving.health import INFERENCE_SERVICE, NOT_SERVING
from tests.worker.conftest import StartWorker, WorkerHandle, rpc_error
from tests.worker.doubles import SCRATCH_PER_TOKEN, HeldMemoryLM

ACTIVE = types_pb2.WORKER_STATE_ACTIVE
ASLEEP = types_pb2.WORKER_STATE_ASLEEP
FAILED = types_pb2.WORKER_STATE_FAILED
LEAK = 64 * 1024
SLACK = 1024


async def start_held(start_worker: StartWorker, lm_dir: Path, **overrides: object) -> WorkerHandle:
    return await start_worker(
        lm_dir, "ar", "transformers", runner_factory=HeldMemoryLM, **overrides
    )


def held_runner(worker: WorkerHandle) -> HeldMemoryLM:
    runner = worker.server.worker.runner
    assert isinstance(runner, HeldMemoryLM)
    return runner


async def tokens(worker: WorkerHandle) -> list[int]:
    return list((await worker.generate(prompt="the cat sat", max_new_tokens=6)).text.token_ids)


async def test_residual_above_bound_fails_and_a_later_sleep_measures_again(
    start_worker: StartWorker, lm_dir: Path
) -> None:
    worker = await start_held(start_worker, lm_dir, residual_slack=SLACK)
    runner = held_runner(worker)
    reference = await tokens(worker)
    runner.leak_on_sleep = LEAK

    failed = await worker.sleep(1, task_id="leaky")
    assert not failed.ok
    assert failed.error == (
        f"device memory still used after sleep: {LEAK} bytes measured, above the bound of "
        f"{SLACK} bytes (baseline + residual slack)"
    )
    assert failed.state == FAILED  # never ASLEEP while the memory may still be held
    assert failed.level == types_pb2.SLEEP_LEVEL_OFFLOAD  # where the weights are
    assert failed.used_after_bytes == LEAK and failed.residual_bound_bytes == SLACK
    status = await worker.status()
    assert status.state == FAILED and status.error == failed.error
    assert await worker.health(INFERENCE_SERVICE) == NOT_SERVING

    # No wake, no request, while it is failed: the operator fences it (or sleeps it again).
    err = await rpc_error(worker.wake())
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.details() == f"worker failed: {failed.error}"
    err = await rpc_error(worker.generate())
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert (await worker.status()).state == FAILED

    # A later sleep measures again: still held, still failed.
    again = await worker.sleep(1, task_id="recheck-1")
    assert not again.ok and again.state == FAILED and again.used_after_bytes == LEAK
    # The memory comes back (a late free): the next sleep finds it released, at level 2 too.
    runner.leftover = None
    recovered = await worker.sleep(2, task_id="recheck-2")
    assert recovered.ok, recovered.error
    assert recovered.state == ASLEEP and recovered.level == types_pb2.SLEEP_LEVEL_DISCARD
    assert recovered.used_before_bytes == 0 and recovered.used_after_bytes == 0
    status = await worker.status()
    assert status.state == ASLEEP and status.error == ""
    runner.leak_on_sleep = 0
    woke = await worker.wake()
    assert woke.ok, woke.error
    assert await tokens(worker) == reference


async def test_peak_while_active(start_worker: StartWorker, lm_dir: Path) -> None:
    worker = await start_held(start_worker, lm_dir)
    status = await worker.status()
    weights = status.active_footprint_bytes
    assert weights > 0 and status.peak_active_bytes == weights == status.used_bytes
    assert status.context_bytes == 0  # the plain accounting device has no context

    await worker.generate(max_new_tokens=8)  # keeps 8 tokens' activations after it ends
    await worker.generate(max_new_tokens=1)  # then only 1 token's
    status = await worker.status()
    assert status.used_bytes == weights + SCRATCH_PER_TOKEN
    assert status.peak_active_bytes == weights + 8 * SCRATCH_PER_TOKEN  # measured after each
    assert status.active_footprint_bytes == weights  # as after the wake, unchanged

    slept = await worker.sleep(1)
    assert slept.ok, slept.error
    assert slept.peak_active_bytes == weights + 8 * SCRATCH_PER_TOKEN
    assert (await worker.status()).peak_active_bytes == slept.peak_active_bytes  # kept asleep
    woke = await worker.wake()
    assert woke.ok
    assert woke.peak_active_bytes == slept.peak_active_bytes  # the peak before this wake
    status = await worker.status()
    assert status.peak_active_bytes == weights == woke.used_after_bytes  # a new active period
