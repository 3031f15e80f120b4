"""A pipeline run in one process: the reference a served pipeline's outputs must equal.

The same model directories the stages load, the same calls their runners make (the encoder's
last hidden state, the diffusers pipeline with those embeds, and a mask where it takes one, a
generator seeded per request on the pipeline's device).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from omnistage_worker.runners.frames import png


class InProcessPipeline:
    """An encoder (a causal LM's base model) feeding a diffusers pipeline's prompt embeds."""

    def __init__(
        self,
        encoder_dir: Path,
        diffusion_dir: Path,
        device: str = "cpu",
        dtype: torch.dtype | None = None,
    ) -> None:
        from diffusers import DiffusionPipeline
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from omnistage_worker.runners.diffusion_embeds import absent_components

        self.device = torch.device(device)
        model: Any = AutoModelForCausalLM.from_pretrained(
            str(encoder_dir), local_files_only=True, dtype=dtype
        )
        self.model = model.to(self.device)
        self.model.eval()
        self.tokenizer = AutoTokenizer.from_pretrained(str(encoder_dir), local_files_only=True)
        absent = dict.fromkeys(absent_components(diffusion_dir))
        self.pipe = DiffusionPipeline.from_pretrained(  # type: ignore[no-untyped-call]
            str(diffusion_dir), local_files_only=True, torch_dtype=dtype, **absent
        ).to(self.device)
        self.pipe.set_progress_bar_config(disable=True)
        self.takes_mask = "prompt_embeds_mask" in inspect.signature(self.pipe.__call__).parameters

    def encode(self, prompt: str) -> torch.Tensor:
        with torch.inference_mode():
            ids = torch.tensor([self.tokenizer(prompt)["input_ids"]], device=self.device)
            hidden: torch.Tensor = self.model.base_model(input_ids=ids).last_hidden_state[0]
        return hidden

    def images(
        self, prompts: Sequence[str], seeds: Sequence[int], fields: Mapping[str, Any]
    ) -> list[bytes]:
        """PNG bytes per prompt, each run alone with its seed (as a batch of one)."""
        out = []
        for prompt, seed in zip(prompts, seeds, strict=True):
            embeds = self.encode(prompt)[None].to(self.pipe.dtype)
            mask = torch.ones(embeds.shape[:2], dtype=torch.int64, device=self.device)
            extra = {"prompt_embeds_mask": mask} if self.takes_mask else {}
            with torch.inference_mode():
                image = self.pipe(
                    prompt_embeds=embeds,
                    generator=torch.Generator(device=self.device).manual_seed(seed),
                    output_type="pil",
                    **extra,
                    **fields,
                ).images[0]
            out.append(png(image))
        return out
