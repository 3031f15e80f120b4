"""Model directories for the stand-in engine: ``config.json`` and one safetensors file, no
tokenizer (the worker then sends token ids, as it does to real vLLM without a tokenizer)."""

from __future__ import annotations

from pathlib import Path

STANDIN_PATH = Path(__file__).resolve().parent  # put on PYTHONPATH: ``import vllm`` = stand-in


def build_standin_model(directory: Path, weights: int = 400_000, vocab: int = 256) -> Path:
    """A directory whose ``model.safetensors`` holds about ``weights`` bytes of float32."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(f'{{"vocab_size": {vocab}, "model_type": "llama"}}')
    generator = torch.Generator().manual_seed(0)
    tensor = torch.randn(weights // 4, generator=generator)
    save_file({"w": tensor}, str(directory / "model.safetensors"))
    return directory
