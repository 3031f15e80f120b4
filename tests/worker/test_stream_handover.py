"""Streams under batching wake the event loop once per decode step, not once per row and token:
the decode thread hands a step's chunks to the loop in one hand-over (each a turn of the GIL
that the decode thread, launching kernels from Python on a GPU, waits for)."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

import httpx

from tests.worker.conftest import StartWorker

DECODE_THREAD = "omnistage-decode-batch"
CLIENTS = 6
TOKENS = 12


async def test_a_decode_step_hands_its_chunks_to_the_loop_once(
    start_worker: StartWorker, lm_dir: Path
) -> None:
    handle = await start_worker(
        lm_dir, "ar", "transformers", http_port=0, cpu_threads=1, max_batch=8, served_model_name="m"
    )
    batcher = handle.server.worker.runner.batcher()  # type: ignore[attr-defined]
    loop: Any = asyncio.get_running_loop()
    handovers = 0
    original = loop.call_soon_threadsafe

    def counted(callback: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal handovers
        handovers += threading.current_thread().name == DECODE_THREAD
        return original(callback, *args, **kwargs)

    async def streamed(client: httpx.AsyncClient, index: int) -> int:
        body = {"model": "m", "prompt": f"the cat sat {index}", "max_tokens": TOKENS,
                "temperature": 0, "stream": True}  # fmt: skip
        url = f"http://127.0.0.1:{handle.server.http_port}/v1/completions"
        chunks = 0
        async with client.stream("POST", url, json=body) as reply:
            assert reply.status_code == 200
            async for line in reply.aiter_lines():
                chunks += line.startswith("data: {") and bool(json.loads(line[6:])["choices"])
        return chunks

    steps, rows = batcher.steps, batcher.row_steps
    loop.call_soon_threadsafe = counted
    try:
        async with httpx.AsyncClient(timeout=60) as client:
            events = await asyncio.gather(*(streamed(client, i) for i in range(CLIENTS)))
    finally:
        del loop.call_soon_threadsafe  # the loop's own method again
    steps, rows = batcher.steps - steps, batcher.row_steps - rows
    assert all(n >= 2 for n in events)
    assert rows > steps  # the streams did run together
    # One hand-over per step at most (the rows' chunks together), not one per row and token.
    assert 0 < handovers <= steps < CLIENTS * TOKENS
