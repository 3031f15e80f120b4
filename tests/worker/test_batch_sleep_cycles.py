"""Sleep and wake with batches in flight: 100 cycles under concurrent load over real gRPC.

An OnDemand worker (requests that arrive while it sleeps are held, then served) with a tiny
real model: clients keep sending requests while the test sleeps and wakes it. Each sleep waits
for the running batch, each ACK measures nothing left on the device, and every request is
answered with the output it gives alone.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from omnistage.worker.v1 import types_pb2
from tests.worker.conftest import StartWorker, WorkerHandle, wait_for

CYCLES = 100
CLIENTS = 6
PROMPTS = ["the cat sat on the mat", "a dog ran", "we like to read books"]


async def test_no_request_lost_across_100_cycles_with_batches_in_flight(
    start_worker: StartWorker, lm_dir: Path
) -> None:
    worker = await start_worker(
        lm_dir, "ar", "transformers", cpu_threads=1, max_batch=4, activation="ondemand"
    )
    fields = [{"prompt": p, "max_new_tokens": 12} for p in PROMPTS]
    references = [list((await worker.generate(**f)).text.token_ids) for f in fields]
    runner = worker.server.worker.runner
    answered: list[int] = [0] * CLIENTS
    batch_sizes: list[int] = []
    stop = asyncio.Event()

    async def client(index: int) -> None:
        turn = index
        while not stop.is_set():
            which = turn % len(fields)
            response = await worker.generate(**fields[which])
            assert list(response.text.token_ids) == references[which], f"client {index}"
            batch_sizes.append(response.batch_size)
            answered[index] += 1
            turn += 1

    clients = [asyncio.ensure_future(client(i)) for i in range(CLIENTS)]
    drained = 0
    try:
        for cycle in range(CYCLES):
            await wait_for(
                lambda: _running(worker), what=f"cycle {cycle}: a batch in flight", within=60
            )
            slept = await worker.sleep(1 + cycle % 2, task_id=f"sleep-{cycle}")
            assert slept.ok, slept.error
            assert slept.state == types_pb2.WORKER_STATE_ASLEEP
            assert slept.used_after_bytes == 0, f"cycle {cycle}: the KV cache stayed"
            assert runner.transient_bytes() == 0
            drained += slept.drain_duration.ToNanoseconds() > 0
            woke = await worker.wake(task_id=f"wake-{cycle}")
            assert woke.ok, woke.error
            for task in clients:
                if task.done():
                    task.result()  # a client's failure surfaces here
    finally:
        stop.set()
        results = await asyncio.gather(*clients, return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[0]
    assert drained > CYCLES // 2  # most sleeps found a batch in flight and waited for it
    assert max(batch_sizes) > 1
    assert sum(answered) >= CYCLES  # requests kept being served between the cycles
    status = await worker.status()
    assert status.inflight_requests == 0 and status.state == types_pb2.WORKER_STATE_ACTIVE


async def _running(worker: WorkerHandle) -> bool:
    return worker.server.worker.runner.transient_bytes() > 0
