"""A Qwen-Image-shaped pipeline split into its two stages, built from configs with random
weights (nothing downloaded).

- the encoder stage: a Qwen2 causal LM shaped like Qwen2.5-VL-7B's language model (hidden
  3584, 28 layers: about 15 GiB in bf16), served by an AR Transformers stage and called with
  ``Encode``;
- the DiT stage: a ``QwenImagePipeline`` without its text encoder and tokenizer (it takes
  ``prompt_embeds`` and ``prompt_embeds_mask``), Qwen-Image's MMDiT (60 layers, 24 heads of
  128: about 20B parameters, 38 GiB in bf16) and its VAE.

``FULL`` is for the GPU host (``bench/pipeline.py``), ``TINY`` for tests and ``--tiny``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class QwenImageSize:
    """The dimensions of each component."""

    hidden: int  # the encoder's width = the DiT's joint_attention_dim
    enc_layers: int
    enc_heads: int
    enc_kv_heads: int
    enc_ff: int
    vocab: int
    dit_layers: int
    dit_heads: int
    dit_head_dim: int
    axes_rope: tuple[int, int, int]
    vae_base: int
    vae_mult: tuple[int, ...]


TINY = QwenImageSize(
    hidden=16, enc_layers=2, enc_heads=4, enc_kv_heads=2, enc_ff=32, vocab=0,
    dit_layers=1, dit_heads=2, dit_head_dim=8, axes_rope=(2, 2, 4), vae_base=4,
    vae_mult=(1, 1, 1, 1),
)  # fmt: skip
FULL = QwenImageSize(
    hidden=3584, enc_layers=28, enc_heads=28, enc_kv_heads=4, enc_ff=18944, vocab=152064,
    dit_layers=60, dit_heads=24, dit_head_dim=128, axes_rope=(16, 56, 56), vae_base=96,
    vae_mult=(1, 2, 4, 4),
)  # fmt: skip


def build_encoder(size: QwenImageSize, directory: Path, device: str = "cpu") -> Path:
    """The encoder stage's model directory (a WordLevel tokenizer: only the sizes matter)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tests.worker.tiny_models import word_level_tokenizer

    tokenizer_dir = word_level_tokenizer(directory)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    config = Qwen2Config(
        vocab_size=size.vocab or len(tokenizer),
        hidden_size=size.hidden,
        intermediate_size=size.enc_ff,
        num_hidden_layers=size.enc_layers,
        num_attention_heads=size.enc_heads,
        num_key_value_heads=size.enc_kv_heads,
        max_position_embeddings=4096,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model: Any = Qwen2ForCausalLM(config)
    model = model.to(dtype)
    model.save_pretrained(str(directory), safe_serialization=True)
    return directory


def dit_pipeline(size: QwenImageSize, device: str = "cpu") -> Any:
    """``QwenImagePipeline`` with its MMDiT and VAE, no text encoder or tokenizer."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )

    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        transformer: Any = QwenImageTransformer2DModel(  # type: ignore[no-untyped-call]
            patch_size=2,
            in_channels=64,
            out_channels=16,
            num_layers=size.dit_layers,
            attention_head_dim=size.dit_head_dim,
            num_attention_heads=size.dit_heads,
            joint_attention_dim=size.hidden,
            axes_dims_rope=size.axes_rope,
        )
        transformer = transformer.to(dtype)
        vae: Any = AutoencoderKLQwenImage(  # type: ignore[no-untyped-call]
            base_dim=size.vae_base, z_dim=16, dim_mult=list(size.vae_mult), num_res_blocks=1
        )
        vae = vae.to(dtype)
    scheduler = FlowMatchEulerDiscreteScheduler()  # type: ignore[no-untyped-call]
    return QwenImagePipeline(  # type: ignore[no-untyped-call]
        scheduler=scheduler, vae=vae, text_encoder=None, tokenizer=None, transformer=transformer
    )


def build_dit(size: QwenImageSize, directory: Path, device: str = "cpu") -> Path:
    """The DiT stage's model directory."""
    dit_pipeline(size, device).save_pretrained(str(directory), safe_serialization=True)
    return directory
