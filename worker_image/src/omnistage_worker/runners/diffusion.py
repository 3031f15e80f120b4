"""Diffusers runner: a ``DiffusionPipeline`` from a local directory; Generate returns a PNG."""

from __future__ import annotations

import inspect
import io
import json
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
        self._files: dict[str, list[Path]] = {}

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
        self._call_params = set(inspect.signature(pipe.__call__).parameters)
        log.info(
            "loaded %s with components %s in %.2fs",
            type(pipe).__name__,
            ", ".join(sorted(self._modules)),
            time.monotonic() - started,
        )

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
        generator = torch.Generator(device=self.device).manual_seed(request.seed)
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
