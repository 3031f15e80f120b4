"""Concurrent diffusion requests of one size and parameters run as one pipeline call (real
tiny pipelines over real gRPC): each image or video equals what its request alone makes with
its seed, and each answer says how many ran together; other sizes wait for their own call."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from omnistage.worker.v1 import inference_service_pb2
from tests.worker.conftest import StartWorker, WorkerHandle

P = inference_service_pb2.ParameterValue
Response = inference_service_pb2.GenerateResponse
TOLERANCE = 2  # of 255: batched float math may round a pixel differently


def pixels(png: bytes) -> np.ndarray[Any, Any]:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.int16)


def assert_same_image(a: bytes, b: bytes) -> None:
    diff = np.abs(pixels(a) - pixels(b))
    assert diff.max() <= TOLERANCE, f"max pixel difference {diff.max()}"


async def run_all(worker: WorkerHandle, requests: list[dict[str, Any]]) -> list[Response]:
    return list(await asyncio.gather(*(worker.generate(**r) for r in requests)))


async def test_same_size_requests_batch_and_equal_unbatched(
    start_worker: StartWorker, diffusion_dir: Path
) -> None:
    worker = await start_worker(diffusion_dir, "diffusion", "diffusers", max_batch=4)
    same = {"height": 32, "width": 32, "num_inference_steps": 20, "guidance_scale": 5.0}
    requests = [{**same, "prompt": p, "seed": s} for p, s in (("a cat", 1), ("a dog", 2))]
    requests += [{**same, "prompt": "a cat", "seed": s} for s in (3, 4, 5)]
    alone = [await worker.generate(**r) for r in requests]
    assert all(r.batch_size == 1 for r in alone)
    together = await run_all(worker, requests)
    sizes = [r.batch_size for r in together]
    assert max(sizes) > 1 and max(sizes) <= 4, sizes  # batched, never above --max-batch
    for one, batched in zip(alone, together, strict=True):
        assert_same_image(one.image.png, batched.image.png)
    # Different seeds of the same prompt gave different images inside one batch.
    assert together[2].image.png != together[3].image.png


async def test_other_sizes_and_parameters_run_in_their_own_calls(
    start_worker: StartWorker, diffusion_dir: Path
) -> None:
    worker = await start_worker(diffusion_dir, "diffusion", "diffusers", max_batch=8)
    base = {"prompt": "a cat", "seed": 1, "num_inference_steps": 20}
    requests = [
        {**base, "height": 32, "width": 32},
        {**base, "height": 32, "width": 32, "seed": 2},
        {**base, "height": 16, "width": 32},
        {**base, "height": 32, "width": 32, "parameters": {"eta": P(double_value=0.5)}},
    ]
    alone = [await worker.generate(**r) for r in requests]
    together = await run_all(worker, requests)
    for one, batched in zip(alone, together, strict=True):
        assert_same_image(one.image.png, batched.image.png)
    assert together[2].batch_size == 1  # its size is its own
    assert together[3].batch_size == 1  # its parameters are its own


async def test_flux_and_video_batches_equal_unbatched(
    start_worker: StartWorker, flux_dir: Path, wan_dir: Path
) -> None:
    flux = await start_worker(flux_dir, "diffusion", "diffusers", max_batch=4)
    fields = {
        "height": 32,
        "width": 48,
        "num_inference_steps": 4,
        "parameters": {"max_sequence_length": P(int_value=8)},
    }
    requests = [{**fields, "prompt": "a cat", "seed": s} for s in range(4)]
    alone = [await flux.generate(**r) for r in requests]
    together = await run_all(flux, requests)
    assert max(r.batch_size for r in together) > 1
    for one, batched in zip(alone, together, strict=True):
        assert_same_image(one.image.png, batched.image.png)

    wan = await start_worker(wan_dir, "diffusion", "diffusers", max_batch=4)
    video = {
        "height": 16,
        "width": 32,
        "num_frames": 5,
        "num_inference_steps": 3,
        "parameters": {"max_sequence_length": P(int_value=8)},
    }
    requests = [{**video, "prompt": "a cat", "seed": s} for s in range(3)]
    alone = [await wan.generate(**r) for r in requests]
    together = await run_all(wan, requests)
    assert max(r.batch_size for r in together) > 1
    for one, batched in zip(alone, together, strict=True):
        assert len(batched.video.frames_png) == 5
        for a, b in zip(one.video.frames_png, batched.video.frames_png, strict=True):
            assert_same_image(a, b)
