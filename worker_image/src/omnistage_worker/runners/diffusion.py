"""Diffusers runner: a ``DiffusionPipeline`` from a local directory; Generate returns PNGs
(one image, or one per video frame)."""

from __future__ import annotations

import inspect
import json
import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from omnistage.worker.v1 import inference_service_pb2, types_pb2
from omnistage_worker.config import WorkerConfig
from omnistage_worker.runners.base import (
    InvalidRequest,
    SleepController,
    TorchRunner,
    safetensors_in,
)
from omnistage_worker.runners.components import discover
from omnistage_worker.runners.frames import png, to_pil, video_frames
from omnistage_worker.runners.pipeline_call import (
    Scalar,
    SizeRules,
    check_parameters,
    check_sizes,
    size_rules,
)

log = logging.getLogger(__name__)

MAX_FRAMES = 1025
VIDEO_FPS = {"Wan": 16.0}
"""Frame rates of the video families' models (the rate their exports use)."""


class DiffusionRunner(TorchRunner):
    """Every ``nn.Module`` component of the pipeline is handed to the weight engine, each as a
    component that sleeps separately (declared ones first, see :mod:`.components`)."""

    runner_kind = types_pb2.RUNNER_DIFFUSION
    backend_kind = types_pb2.BACKEND_DIFFUSERS

    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config)
        self.pipeline: Any = None
        self._modules: dict[str, torch.nn.Module] = {}
        self._call_params: set[str] = set()
        self._signature = inspect.Signature()
        self._files: dict[str, list[Path]] = {}
        self._components: dict[str, torch.nn.Module] = {}

    def load(self) -> None:
        from diffusers import DiffusionPipeline

        started = time.monotonic()
        self._files = self._component_files()
        self.resolve_dtype([], [p for paths in self._files.values() for p in paths])
        kwargs: dict[str, Any] = {"local_files_only": True, "torch_dtype": self.dtype}
        if self.config.variant:
            kwargs["variant"] = self.config.variant
        pipe = DiffusionPipeline.from_pretrained(str(self.model_dir), **kwargs)  # type: ignore[no-untyped-call]
        pipe.set_progress_bar_config(disable=True)
        self.pipeline = pipe
        self._modules = {
            name: comp
            for name, comp in pipe.components.items()
            if isinstance(comp, torch.nn.Module)
        }
        self._components = discover(pipe, self._modules, self.config.components)
        self._signature = inspect.signature(pipe.__call__)
        self._call_params = set(self._signature.parameters)
        log.info(
            "loaded %s with components %s in %.2fs",
            type(pipe).__name__,
            ", ".join(self._components),
            time.monotonic() - started,
        )

    def build_controller(self) -> SleepController:
        """Components sleep separately: each has its own slice of the engine's buffers."""
        from omnistage_worker.engine.components import ComponentEngine

        engine: SleepController = ComponentEngine(
            self._components,
            self.device,
            self.weight_files(),
            host_copy=self.config.sleep_level == 1,
            sequential=self.config.sequential,
        )
        return engine

    def modules(self) -> Mapping[str, torch.nn.Module]:
        return self._modules

    def _component_files(self) -> dict[str, list[Path]]:
        """Per component folder of the pipeline, the weight files the loaders read there."""
        try:
            index = json.loads((self.model_dir / "model_index.json").read_text())
        except (OSError, ValueError):
            index = {}
        names = [n for n in index if not n.startswith("_")] if isinstance(index, dict) else []
        files = {n: safetensors_in(self.model_dir / n, self.config.variant) for n in names}
        return {n: paths for n, paths in files.items() if paths}

    def weight_files(self) -> Mapping[str, Sequence[Path]] | None:
        """Files per component that has them (others are kept on the host at level 2)."""
        files = {n: p for n, p in self._files.items() if n in self._modules}
        missing = sorted(set(self._modules) - set(files))
        if missing:
            log.warning("no safetensors for %s: kept on the host at level 2", ", ".join(missing))
        return files or None

    def _size_rules(self) -> SizeRules:
        pipe = self.pipeline
        facts = {
            name: getattr(pipe, name, None)
            for name in (
                "vae_scale_factor",
                "vae_scale_factor_spatial",
                "vae_scale_factor_temporal",
                "patch_size",
            )
        }
        ints = {k: v if isinstance(v, int) else None for k, v in facts.items()}
        return size_rules(type(pipe).__name__, ints)

    @property
    def makes_video(self) -> bool:
        """Whether the pipeline makes videos (it takes ``num_frames``)."""
        return "num_frames" in self._call_params

    def validate(self, request: inference_service_pb2.GenerateRequest) -> None:
        super().validate(request)
        if request.num_frames < 0:
            raise InvalidRequest("num_frames", f"{request.num_frames} is negative")
        if request.num_frames > MAX_FRAMES:
            raise InvalidRequest("num_frames", f"{request.num_frames} is above {MAX_FRAMES}")
        check_sizes(
            self._size_rules(), request.height, request.width, request.num_frames, self.makes_video
        )
        self._parameters(request)

    def _parameters(self, request: inference_service_pb2.GenerateRequest) -> dict[str, Scalar]:
        values: dict[str, Scalar] = {}
        for name, value in request.parameters.items():
            kind = value.WhichOneof("kind")
            if kind is None:
                raise InvalidRequest(f"parameters[{name}]", "has no value")
            values[name] = getattr(value, kind)
        owner = type(self.pipeline).__name__
        return check_parameters(self._signature, owner, values)

    def _generate(
        self, request: inference_service_pb2.GenerateRequest
    ) -> inference_service_pb2.GenerateResponse:
        started = time.monotonic()
        generator = torch.Generator(device=self.device).manual_seed(request.seed)
        kwargs: dict[str, Any] = {"generator": generator, "output_type": "pil"}
        optional = {
            "num_inference_steps": request.num_inference_steps,
            "height": request.height,
            "width": request.width,
            "guidance_scale": request.guidance_scale,
            "num_frames": request.num_frames,
        }
        for name, value in optional.items():
            if value and name in self._call_params:
                kwargs[name] = value
        kwargs.update(self._parameters(request))
        with torch.inference_mode():
            result = self.pipeline(request.prompt, **kwargs)
        response = inference_service_pb2.GenerateResponse(request_id=request.request_id)
        if self.makes_video:
            frames = video_frames(result.frames)
            response.video.CopyFrom(
                inference_service_pb2.VideoOutput(
                    frames_png=[png(f) for f in frames],
                    width=frames[0].width,
                    height=frames[0].height,
                    fps=VIDEO_FPS.get(type(self.pipeline).__name__.split("Pipeline")[0], 0.0),
                )
            )
        else:
            image = to_pil(result.images[0])
            response.image.CopyFrom(
                inference_service_pb2.ImageOutput(
                    png=png(image), width=image.width, height=image.height
                )
            )
        response.duration.FromNanoseconds(int((time.monotonic() - started) * 1e9))
        return response
