"""Bounds on one request (``--max-*`` flags, the operator's ``spec.limits``): refused naming the
field before anything is held or queued, over HTTP and gRPC alike."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import httpx

from omnistage_worker.limits import RequestLimits
from tests.worker.conftest import StartWorker, WorkerHandle, rpc_error

LIMITS = RequestLimits(request_body_bytes=2048, prompt_tokens=4, image_side=64, frames=9)


async def _chunks() -> AsyncIterator[bytes]:
    for _ in range(8):
        yield b"x" * 512


def http(worker: WorkerHandle) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=f"http://127.0.0.1:{worker.server.http_port}", timeout=60)


async def test_text_limits_refuse_before_holding(start_worker: StartWorker, lm_dir: Path) -> None:
    # Asleep and OnDemand: a request within the bounds would be held; one over them is not.
    worker = await start_worker(
        lm_dir,
        "ar",
        "transformers",
        http_port=0,
        limits=LIMITS,
        activation="ondemand",
        initial_state="asleep",
    )
    async with http(worker) as client:
        long = await client.post("/v1/completions", json={"prompt": "the cat sat on the mat"})
        assert long.status_code == 400
        error = long.json()["error"]
        assert error["param"] == "prompt" and "above this stage's limit of 4" in error["message"]
        chat = await client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "the cat sat on the mat"}]},
        )
        assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"
        # the tiny model's length is 128: a 3-token prompt leaves 125
        over = await client.post(
            "/v1/completions", json={"prompt": "the cat sat", "max_tokens": 126}
        )
        assert over.status_code == 400 and over.json()["error"]["param"] == "max_tokens"
        assert "125 tokens the model's length of 128 leaves" in over.json()["error"]["message"]
        big = await client.post("/v1/completions", json={"prompt": "a" * 3000})
        assert big.status_code == 413
        assert big.json()["error"]["code"] == "request_too_large"
        chunked = await client.post(  # no Content-Length: counted while read
            "/v1/completions",
            content=_chunks(),
            headers={"content-type": "application/json"},
        )
        assert chunked.status_code == 413
    error = await rpc_error(worker.generate(prompt="the cat sat on the mat"))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (error.details() or "").startswith("prompt:")
    figures = worker.server.worker.demand.figures()
    assert figures.held_total == 0  # nothing was held


async def test_image_and_frame_limits(start_worker: StartWorker, diffusion_dir: Path) -> None:
    worker = await start_worker(diffusion_dir, "diffusion", "diffusers", http_port=0, limits=LIMITS)
    async with http(worker) as client:
        wide = await client.post(
            "/v1/images/generations", json={"prompt": "a red square", "size": "128x64"}
        )
        assert wide.status_code == 400 and wide.json()["error"]["param"] == "size"
        assert "above this stage's limit of 64" in wide.json()["error"]["message"]
        fits = await client.post(
            "/v1/images/generations",
            json={"prompt": "a red square", "size": "64x64", "num_inference_steps": 2},
        )
        assert fits.status_code == 200, fits.text
    error = await rpc_error(worker.generate(prompt="a cat", height=72, width=64))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (error.details() or "").startswith("height:")
    # frames come over gRPC (the OpenAI images API has none): over the limit before the
    # pipeline's own check (an image pipeline would say it makes no videos)
    error = await rpc_error(worker.generate(prompt="a cat", num_frames=17))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (error.details() or "").startswith("num_frames: 17 is above this stage's limit of 9")
