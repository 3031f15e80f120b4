"""Generate for the pipeline families users run: video frames, per-pipeline sizes, and
pipeline-specific parameters checked against the call signature."""

from __future__ import annotations

import inspect
import io
from pathlib import Path

import grpc
import pytest
from PIL import Image

from omnistage.worker.v1 import inference_service_pb2
from omnistage_worker.runners.base import InvalidRequest
from omnistage_worker.runners.pipeline_call import (
    SizeRules,
    check_parameters,
    check_sizes,
    size_rules,
)
from tests.worker.conftest import StartWorker

P = inference_service_pb2.ParameterValue


def test_size_rules_per_family() -> None:
    facts: dict[str, int | None] = {"vae_scale_factor": 8, "patch_size": 2}
    assert size_rules("FluxPipeline", facts).side_multiple == 16
    assert size_rules("QwenImagePipeline", facts).side_multiple == 16
    assert size_rules("StableDiffusion3Pipeline", facts).side_multiple == 16
    assert size_rules("StableDiffusionXLPipeline", facts).side_multiple == 8
    wan = size_rules("WanPipeline", {"vae_scale_factor_spatial": 8, "vae_scale_factor_temporal": 4})
    assert wan == SizeRules(16, 4)
    check_sizes(wan, 480, 832, 81, video=True)
    with pytest.raises(InvalidRequest, match="num_frames: 80 - 1 is not a multiple of 4"):
        check_sizes(wan, 480, 832, 80, video=True)
    with pytest.raises(InvalidRequest, match="height: 1000 is not a multiple of 16"):
        check_sizes(size_rules("FluxPipeline", facts), 1000, 1024, 0, video=False)
    with pytest.raises(InvalidRequest, match="num_frames: this pipeline makes images"):
        check_sizes(SizeRules(8), 512, 512, 5, video=False)


def _call(
    prompt: str,
    *,
    negative_prompt: str | list[str] | None = None,
    true_cfg_scale: float = 4.0,
    max_sequence_length: int = 512,
    prompt_embeds: object = None,
    generator: object = None,
) -> None: ...


def test_parameters_checked_against_signature() -> None:
    sig = inspect.signature(_call)
    got = check_parameters(
        sig, "QwenImagePipeline", {"negative_prompt": "blurry", "true_cfg_scale": 4}
    )
    assert got == {"negative_prompt": "blurry", "true_cfg_scale": 4.0}
    assert isinstance(got["true_cfg_scale"], float)
    for params, message in (
        ({"strength": 0.5}, "parameters[strength]: QwenImagePipeline has no parameter 'strength'"),
        ({"max_sequence_length": 1.5}, "parameters[max_sequence_length]: float does not fit"),
        ({"true_cfg_scale": "x"}, "parameters[true_cfg_scale]: str does not fit"),
        ({"true_cfg_scale": True}, "parameters[true_cfg_scale]: bool does not fit"),
        ({"prompt_embeds": "x"}, "parameters[prompt_embeds]: is set by the worker"),
        ({"generator": 1}, "parameters[generator]: is set by the worker"),
        ({"height": 64}, "parameters[height]: set it with the request's height field"),
    ):
        with pytest.raises(InvalidRequest) as info:
            check_parameters(sig, "QwenImagePipeline", params)
        assert str(info.value).startswith(message), str(info.value)


def _png_size(data: bytes) -> tuple[int, int]:
    with Image.open(io.BytesIO(data)) as image:
        assert image.format == "PNG"
        return image.size


async def test_wan_video_frames(start_worker: StartWorker, wan_dir: Path) -> None:
    worker = await start_worker(wan_dir, "diffusion", "diffusers")
    fields = {
        "height": 16,
        "width": 32,
        "num_frames": 5,
        "num_inference_steps": 2,
        "parameters": {
            "max_sequence_length": P(int_value=8),
            "negative_prompt": P(string_value="x"),
        },
    }
    response = await worker.generate(**fields)
    video = response.video
    assert response.WhichOneof("output") == "video"
    assert len(video.frames_png) == 5
    assert (video.width, video.height, video.fps) == (32, 16, 16.0)
    assert all(_png_size(f) == (32, 16) for f in video.frames_png)
    again = await worker.generate(**fields)
    assert list(again.video.frames_png) == list(video.frames_png)
    for bad, field in (
        ({"num_frames": 4}, "num_frames: 4 - 1 is not a multiple of 4"),
        ({"height": 24}, "height: 24 is not a multiple of 16"),
        ({"parameters": {"true_cfg_scale": P(double_value=4.0)}}, "parameters[true_cfg_scale]"),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await worker.generate(**{**fields, **bad})
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (info.value.details() or "").startswith(field), info.value.details()


async def test_flux_sizes_and_parameters(start_worker: StartWorker, flux_dir: Path) -> None:
    worker = await start_worker(flux_dir, "diffusion", "diffusers")
    ok = {
        "height": 32,
        "width": 48,
        "num_inference_steps": 2,
        "parameters": {"max_sequence_length": P(int_value=8)},
    }
    response = await worker.generate(**ok)
    assert _png_size(response.image.png) == (48, 32)
    for bad, field in (
        ({"height": 30}, "height: 30 is not a multiple of 4"),  # tiny VAE: scale 2, packed 2x2
        ({"num_frames": 5}, "num_frames: this pipeline makes images"),
        ({"parameters": {"max_sequence_length": P(string_value="8")}}, "parameters[max_seq"),
        ({"parameters": {"latents": P(int_value=1)}}, "parameters[latents]"),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await worker.generate(**{**ok, **bad})
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (info.value.details() or "").startswith(field), info.value.details()
