"""Diffusers runner: a ``DiffusionPipeline`` from a local directory; Generate returns PNGs
(one image, or one per video frame)."""

from __future__ import annotations

import inspect
import json
import logging
import time
from collections.abc import Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from omnistage.worker.v1 import inference_service_pb2, types_pb2
from omnistage_worker.config import WorkerConfig
from omnistage_worker.runners.base import (
    InvalidRequest,
    SleepController,
    TextChunkSink,
    TorchRunner,
    safetensors_in,
)
from omnistage_worker.runners.components import discover
from omnistage_worker.runners.diffusion_embeds import (
    absent_components,
    call_arguments,
    check_embeds,
    embeds_width,
)
from omnistage_worker.runners.diffusion_embeds import batch_key as embeds_key
from omnistage_worker.runners.embeds import MAX_EMBEDS_BYTES
from omnistage_worker.runners.frames import png, to_pil, video_frames
from omnistage_worker.runners.group_batch import GroupBatcher
from omnistage_worker.runners.pipeline_call import (
    Scalar,
    SizeRules,
    check_parameters,
    check_sizes,
    size_rules,
)

log = logging.getLogger(__name__)

Response = inference_service_pb2.GenerateResponse

MAX_FRAMES = 1025
VIDEO_FPS = {"Wan": 16.0}
"""Frame rates of the video families' models (the rate their exports use)."""


class DiffusionRunner(TorchRunner):
    """Every ``nn.Module`` component of the pipeline is handed to the weight engine, each as a
    component that sleeps separately (declared ones first, see :mod:`.components`).

    Concurrent requests of the same size and parameters run as one call (up to
    ``--max-batch``, :mod:`.group_batch`); each answer says how many ran together."""

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
        self._batcher: GroupBatcher[inference_service_pb2.GenerateRequest, Response] | None = None

    def load(self) -> None:
        from diffusers import DiffusionPipeline

        started = time.monotonic()
        self._files = self._component_files()
        self.resolve_dtype([], [p for paths in self._files.values() for p in paths])
        kwargs: dict[str, Any] = {"local_files_only": True, "torch_dtype": self.dtype}
        # Components saved as absent (a DiT stage whose text encoder is another stage).
        kwargs.update(dict.fromkeys(absent_components(self.model_dir)))
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
        """Components sleep separately: each has its own slice of the engine's buffers. On
        several GPUs the whole components are dealt over the devices (one engine per device,
        :meth:`TorchRunner._build_sharded`); per-component sleep is then not offered."""
        if self.config.gpus > 1:
            return self._build_sharded()
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
        self._embeds_shape(request)

    def _embeds_shape(self, request: inference_service_pb2.GenerateRequest) -> Any:
        owner = type(self.pipeline).__name__
        width = embeds_width(self.pipeline)
        return check_embeds(request, owner, self._call_params, width, MAX_EMBEDS_BYTES)

    def _parameters(self, request: inference_service_pb2.GenerateRequest) -> dict[str, Scalar]:
        values: dict[str, Scalar] = {}
        for name, value in request.parameters.items():
            kind = value.WhichOneof("kind")
            if kind is None:
                raise InvalidRequest(f"parameters[{name}]", "has no value")
            values[name] = getattr(value, kind)
        owner = type(self.pipeline).__name__
        return check_parameters(self._signature, owner, values)

    @property
    def max_concurrency(self) -> int:
        return self.config.max_batch

    def generate(
        self, request: inference_service_pb2.GenerateRequest, sink: TextChunkSink | None = None
    ) -> inference_service_pb2.GenerateResponse:
        """Run ``request`` in one call with the requests of its size and parameters that wait
        with it (blocking until it is done)."""
        return self._batches().submit(request).result()

    def _batches(self) -> GroupBatcher[inference_service_pb2.GenerateRequest, Response]:
        if self._batcher is None:
            self._batcher = GroupBatcher(
                self._run_batch, self._batch_key, self.config.max_batch, "omnistage-diffusion"
            )
        return self._batcher

    def close(self) -> None:
        if self._batcher is not None:
            self._batcher.close()

    def _batch_key(self, request: inference_service_pb2.GenerateRequest) -> Hashable:
        """What requests must share to run in one call: everything but prompt and seed."""
        return (
            tuple(sorted(self._call_sizes(request).items())),
            tuple(sorted(self._parameters(request).items())),
            embeds_key(request),
        )

    def _call_sizes(self, request: inference_service_pb2.GenerateRequest) -> dict[str, Any]:
        optional = {
            "num_inference_steps": request.num_inference_steps,
            "height": request.height,
            "width": request.width,
            "guidance_scale": request.guidance_scale,
            "num_frames": request.num_frames,
        }
        return {n: v for n, v in optional.items() if v and n in self._call_params}

    def _generate(self, request: inference_service_pb2.GenerateRequest) -> Response:
        return self._run_batch([request])[0]

    def _run_batch(self, requests: list[inference_service_pb2.GenerateRequest]) -> list[Response]:
        """One pipeline call for requests of one key: a list of prompts and one seeded
        generator per request, so each output is what its request alone makes with its seed."""
        started = time.monotonic()
        # The pipeline draws its noise on its execution device (with components on several
        # devices: the first hooked component's), so the generators live there too.
        device = getattr(self.pipeline, "_execution_device", None) or self.device
        generators = [torch.Generator(device=device).manual_seed(r.seed) for r in requests]
        first = requests[0]
        kwargs: dict[str, Any] = {
            "generator": generators if len(requests) > 1 else generators[0],
            "output_type": "pil",
        }
        kwargs.update(self._call_sizes(first))
        kwargs.update(self._parameters(first))
        prompts: Any = [r.prompt for r in requests]
        prompts = prompts if len(requests) > 1 else prompts[0]
        if first.HasField("prompt_embeds"):  # an encoder stage's output: no prompt
            prompts = None
            kwargs.update(
                call_arguments(
                    requests, self._call_params, device, self.pipeline.dtype, MAX_EMBEDS_BYTES
                )
            )
        with torch.inference_mode():
            result = self.pipeline(prompts, **kwargs)
        seconds = time.monotonic() - started
        return [
            self._response(request, result, index, len(requests), seconds)
            for index, request in enumerate(requests)
        ]

    def _response(
        self,
        request: inference_service_pb2.GenerateRequest,
        result: Any,
        index: int,
        batch_size: int,
        seconds: float,
    ) -> Response:
        response = Response(request_id=request.request_id, batch_size=batch_size)
        if self.makes_video:
            frames = video_frames(result.frames, index)
            response.video.CopyFrom(
                inference_service_pb2.VideoOutput(
                    frames_png=[png(f) for f in frames],
                    width=frames[0].width,
                    height=frames[0].height,
                    fps=VIDEO_FPS.get(type(self.pipeline).__name__.split("Pipeline")[0], 0.0),
                )
            )
        else:
            image = to_pil(result.images[index])
            response.image.CopyFrom(
                inference_service_pb2.ImageOutput(
                    png=png(image), width=image.width, height=image.height
                )
            )
        response.duration.FromNanoseconds(int(seconds * 1e9))
        return response
