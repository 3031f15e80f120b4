"""Model directories for the stand-in engine: ``config.json``, one safetensors file and (by
default) a byte-level tokenizer built with the ``tokenizers`` library (``bench/vllm_tokenizer``);
without it the worker sends token ids, as it does to real vLLM without a tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

from bench.vllm_tokenizer import SIZE, save_byte_tokenizer

STANDIN_PATH = Path(__file__).resolve().parent  # put on PYTHONPATH: ``import vllm`` = stand-in


def build_standin_model(
    directory: Path, weights: int = 400_000, vocab: int = SIZE, tokenizer: bool = True,
    max_position_embeddings: int = 2048,
) -> Path:  # fmt: skip
    """A directory whose ``model.safetensors`` holds about ``weights`` bytes of float32."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    config = {"vocab_size": vocab, "model_type": "llama",
              "max_position_embeddings": max_position_embeddings}  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config))
    generator = torch.Generator().manual_seed(0)
    tensor = torch.randn(weights // 4, generator=generator)
    save_file({"w": tensor}, str(directory / "model.safetensors"))
    if tokenizer:
        save_byte_tokenizer(directory, max_position_embeddings)
    return directory
