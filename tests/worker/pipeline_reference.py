"""A pipeline run in one process: the reference a served pipeline's outputs must equal.

The same model directories the stages load, the same calls their runners make (the encoder's
last hidden state, the diffusers pipeline with those embeds and a generator seeded per request).
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

    def __init__(self, encoder_dir: Path, diffusion_dir: Path) -> None:
        from diffusers import DiffusionPipeline
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model = AutoModelForCausalLM.from_pretrained(str(encoder_dir), local_files_only=True)
        self.model.eval()  # type: ignore[no-untyped-call]
        self.tokenizer = AutoTokenizer.from_pretrained(str(encoder_dir), local_files_only=True)
        from omnistage_worker.runners.diffusion_embeds import absent_components

        absent = dict.fromkeys(absent_components(diffusion_dir))
        self.pipe = DiffusionPipeline.from_pretrained(  # type: ignore[no-untyped-call]
            str(diffusion_dir), local_files_only=True, **absent
        )
        self.takes_mask = "prompt_embeds_mask" in inspect.signature(self.pipe.__call__).parameters
        self.pipe.set_progress_bar_config(disable=True)

    def encode(self, prompt: str) -> torch.Tensor:
        with torch.inference_mode():
            ids = torch.tensor([self.tokenizer(prompt)["input_ids"]])
            hidden: torch.Tensor = self.model.base_model(input_ids=ids).last_hidden_state[0]
        return hidden

    def images(
        self, prompts: Sequence[str], seeds: Sequence[int], fields: Mapping[str, Any]
    ) -> list[bytes]:
        """PNG bytes per prompt, each run alone with its seed (as a batch of one)."""
        out = []
        for prompt, seed in zip(prompts, seeds, strict=True):
            embeds = self.encode(prompt)[None]
            mask = {"prompt_embeds_mask": torch.ones(embeds.shape[:2], dtype=torch.int64)}
            with torch.inference_mode():
                image = self.pipe(
                    prompt_embeds=embeds,
                    **(mask if self.takes_mask else {}),
                    generator=torch.Generator().manual_seed(seed),
                    output_type="pil",
                    **fields,
                ).images[0]
            out.append(png(image))
        return out
