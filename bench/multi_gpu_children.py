"""The child processes of ``bench/multi_gpu.py`` that hold the device: a Llama-shaped model of a
given size built with random weights and saved (``--smoke``: tiny, on CPU), and the ballast
tenant that holds memory on each device until its stdin closes."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from bench.worker_grpc import ensure_tokenizer

Json = dict[str, Any]
GiB = 1024**3


def llama_config(gib: float, tiny: bool) -> Any:
    from transformers import LlamaConfig

    if tiny:
        return LlamaConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    hidden, inter, vocab, kv = 4096, 14336, 32000, 1024
    per_layer = 2 * (2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inter + 2 * hidden)
    outside = 2 * (2 * vocab * hidden + hidden)
    layers = max(2, round((gib * GiB - outside) / per_layer))
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    )


def child_build(directory: Path, gib: float, seed: int, tiny: bool) -> Json:
    """Random bf16 weights (the model's own init, seeded) built on cuda:0, saved as safetensors."""
    import torch
    from transformers import LlamaForCausalLM

    if (directory / "config.json").exists():
        return {"built": False}
    start = time.monotonic()
    config = llama_config(gib, tiny)
    dev = torch.device("cpu" if tiny else "cuda:0")
    dtype = torch.float32 if tiny else torch.bfloat16
    torch.manual_seed(seed)  # the model's own init (std 0.02, norms one), on the device
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(dev):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.save_pretrained(directory, safe_serialization=True)
    ensure_tokenizer(directory)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"built": True, "weights_bytes": weights, "seconds": time.monotonic() - start}


def child_ballast(sizes: list[int]) -> None:
    """Hold ``sizes[i]`` bytes on cuda:i until stdin closes; print 'ready' once they are held."""
    import torch

    held = []
    for i, size in enumerate(sizes):
        if size > 0:
            block = torch.empty(size, dtype=torch.uint8, device=f"cuda:{i}")
            block.fill_(1)
            held.append(block)
        torch.cuda.synchronize(i)
    print("ready", flush=True)
    sys.stdin.read()
