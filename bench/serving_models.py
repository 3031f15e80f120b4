"""The models ``bench/serving.py`` builds from configs (random weights): the 16.6 GiB
Llama-shaped causal LM of ``bench/worker_sleep.py`` and a small SD-like diffusers pipeline."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def llm_config(smoke: bool) -> Any:
    """The causal LM's config: 16.6 GiB in bf16, or a tiny one for ``--smoke``."""
    from transformers import LlamaConfig

    if smoke:
        return LlamaConfig(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    return LlamaConfig(  # the 16.6 GiB shape (bench/worker_sleep.py's too)
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    )


def build_sd_like(directory: Path, smoke: bool) -> Path:
    """An SD-like pipeline (UNet, VAE, CLIP text encoder, DDIM) with random weights."""
    if (directory / "model_index.json").exists():
        return directory
    if smoke:
        from tests.worker.tiny_models import build_diffusion_pipeline

        return build_diffusion_pipeline(directory)
    import torch
    from diffusers import (
        AutoencoderKL,
        DDIMScheduler,
        StableDiffusionPipeline,
        UNet2DConditionModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    from tests.worker.tiny_models import write_clip_tokenizer

    torch.manual_seed(0)
    tok_dir = directory.parent / (directory.name + "-tokenizer-src")
    write_clip_tokenizer(tok_dir)
    tokenizer = CLIPTokenizer.from_pretrained(str(tok_dir))
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=512,
            intermediate_size=2048,
            num_hidden_layers=6,
            num_attention_heads=8,
            max_position_embeddings=16,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=2,
        )
    )
    unet = UNet2DConditionModel(  # type: ignore[no-untyped-call]
        sample_size=64,
        in_channels=4,
        out_channels=4,
        block_out_channels=(160, 320, 640, 640),
        layers_per_block=2,
        down_block_types=(
            "CrossAttnDownBlock2D",
            "CrossAttnDownBlock2D",
            "CrossAttnDownBlock2D",
            "DownBlock2D",
        ),
        up_block_types=(
            "UpBlock2D",
            "CrossAttnUpBlock2D",
            "CrossAttnUpBlock2D",
            "CrossAttnUpBlock2D",
        ),
        cross_attention_dim=512,
        attention_head_dim=8,
    )
    vae = AutoencoderKL(  # type: ignore[no-untyped-call]
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(64, 128, 256, 256),
        layers_per_block=2,
        latent_channels=4,
    )
    scheduler = DDIMScheduler(  # type: ignore[no-untyped-call]
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
    )
    pipe: Any = StableDiffusionPipeline(  # type: ignore[no-untyped-call]
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.save_pretrained(str(directory), safe_serialization=True)
    return directory
