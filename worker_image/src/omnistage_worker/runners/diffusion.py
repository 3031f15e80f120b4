"""Diffusers runner: a ``DiffusionPipeline`` from a local directory; Generate returns a PNG."""

from __future__ import annotations

import inspect
import io
import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from omnistage.worker.v1 import inference_service_pb2, types_pb2
from omnistage_worker.config import WorkerConfig
from omnistage_worker.runners.base import InvalidRequest, TorchRunner, safetensors_in

log = logging.getLogger(__name__)


class DiffusionRunner(TorchRunner):
    """Every ``nn.Module`` component of the pipeline is handed to the weight engine."""

    runner_kind = types_pb2.RUNNER_DIFFUSION
    backend_kind = types_pb2.BACKEND_DIFFUSERS

    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config)
        self.pipeline: Any = None
        self._modules: dict[str, torch.nn.Module] = {}
        self._call_params: set[str] = set()

    def load(self) -> None:
        from diffusers import DiffusionPipeline

        started = time.monotonic()
        kwargs: dict[str, Any] = {"local_files_only": True}
        if self.dtype is not None:
            kwargs["torch_dtype"] = self.dtype
        pipe = DiffusionPipeline.from_pretrained(str(self.model_dir), **kwargs)  # type: ignore[no-untyped-call]
        pipe.set_progress_bar_config(disable=True)
        self.pipeline = pipe
        self._modules = {
            name: comp
            for name, comp in pipe.components.items()
            if isinstance(comp, torch.nn.Module)
        }
        self._call_params = set(inspect.signature(pipe.__call__).parameters)
        log.info(
            "loaded %s with components %s in %.2fs",
            type(pipe).__name__,
            ", ".join(sorted(self._modules)),
            time.monotonic() - started,
        )

    def modules(self) -> Mapping[str, torch.nn.Module]:
        return self._modules

    def weight_files(self) -> Mapping[str, Sequence[Path]] | None:
        files: dict[str, Sequence[Path]] = {}
        for name in self._modules:
            found = safetensors_in(self.model_dir / name)
            if not found:
                return None
            files[name] = found
        return files

    def _vae_scale(self) -> int:
        return int(getattr(self.pipeline, "vae_scale_factor", 8) or 8)

    def validate(self, request: inference_service_pb2.GenerateRequest) -> None:
        super().validate(request)
        scale = self._vae_scale()
        for field, value in (("height", request.height), ("width", request.width)):
            if value and value % scale:
                raise InvalidRequest(field, f"{value} is not a multiple of {scale}")

    def _generate(
        self, request: inference_service_pb2.GenerateRequest
    ) -> inference_service_pb2.GenerateResponse:
        started = time.monotonic()
        # The pipeline draws its noise on its execution device (with components on several
        # devices: the first hooked component's), so the generator lives there too.
        device = getattr(self.pipeline, "_execution_device", None) or self.device
        generator = torch.Generator(device=device).manual_seed(request.seed)
        kwargs: dict[str, Any] = {"generator": generator, "output_type": "pil"}
        optional = {
            "num_inference_steps": request.num_inference_steps,
            "height": request.height,
            "width": request.width,
            "guidance_scale": request.guidance_scale,
        }
        for name, value in optional.items():
            if value and name in self._call_params:
                kwargs[name] = value
        with torch.inference_mode():
            result = self.pipeline(request.prompt, **kwargs)
        image = result.images[0]
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        response = inference_service_pb2.GenerateResponse(
            request_id=request.request_id,
            image=inference_service_pb2.ImageOutput(
                png=buffer.getvalue(), width=image.width, height=image.height
            ),
        )
        response.duration.FromNanoseconds(int((time.monotonic() - started) * 1e9))
        return response
