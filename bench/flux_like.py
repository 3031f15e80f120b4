"""A Flux-like pipeline built from configs with random weights (nothing downloaded).

``FULL`` is sized for the GPU bench (T5-XXL-like and CLIP-L-like encoders, a Flux transformer
with half of FLUX.1's blocks, FLUX.1's VAE: about 21 GiB in bf16); ``TINY`` for tests and
``--smoke``. Both use small word-level/BPE tokenizers: only the weights' sizes matter here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class FluxSize:
    """The dimensions of each component."""

    t5_dim: int
    t5_ff: int
    t5_layers: int
    t5_heads: int
    clip_dim: int
    clip_ff: int
    clip_layers: int
    double_blocks: int
    single_blocks: int
    heads: int
    head_dim: int
    axes_rope: tuple[int, int, int]
    vae_channels: tuple[int, ...]
    latent_channels: int


TINY = FluxSize(
    t5_dim=32, t5_ff=37, t5_layers=2, t5_heads=4,
    clip_dim=32, clip_ff=37, clip_layers=2,
    double_blocks=1, single_blocks=1, heads=2, head_dim=16, axes_rope=(4, 4, 8),
    vae_channels=(8, 16), latent_channels=4,
)  # fmt: skip
FULL = FluxSize(
    t5_dim=4096, t5_ff=10240, t5_layers=24, t5_heads=64,
    clip_dim=768, clip_ff=3072, clip_layers=12,
    double_blocks=10, single_blocks=19, heads=24, head_dim=128, axes_rope=(16, 56, 56),
    vae_channels=(128, 256, 512, 512), latent_channels=16,
)  # fmt: skip


def flux_like(size: FluxSize, tokenizer_dir: Path, device: str = "cpu", dtype: Any = None) -> Any:
    """The pipeline, its modules created on ``device`` in ``dtype`` (default float32)."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        FluxPipeline,
        FluxTransformer2DModel,
    )
    from transformers import (
        AutoTokenizer,
        CLIPTextConfig,
        CLIPTextModel,
        CLIPTokenizer,
        T5Config,
        T5EncoderModel,
    )

    from tests.worker.tiny_models import word_level_tokenizer, write_clip_tokenizer

    torch.manual_seed(0)
    write_clip_tokenizer(tokenizer_dir / "clip")
    clip_tokenizer = CLIPTokenizer.from_pretrained(str(tokenizer_dir / "clip"))
    t5_tokenizer = AutoTokenizer.from_pretrained(str(word_level_tokenizer(tokenizer_dir / "t5")))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype or torch.float32)
    try:
        with torch.device(device):
            clip = CLIPTextModel(
                CLIPTextConfig(
                    vocab_size=len(clip_tokenizer),
                    hidden_size=size.clip_dim,
                    intermediate_size=size.clip_ff,
                    num_hidden_layers=size.clip_layers,
                    num_attention_heads=max(1, size.clip_dim // 64) if size.clip_dim >= 64 else 2,
                    max_position_embeddings=16,
                    bos_token_id=0,
                    eos_token_id=1,
                    pad_token_id=2,
                )
            )
            t5 = T5EncoderModel(
                T5Config(
                    vocab_size=max(len(t5_tokenizer), 32128 if size is FULL else 0),
                    d_model=size.t5_dim,
                    d_kv=size.t5_dim // size.t5_heads,
                    d_ff=size.t5_ff,
                    num_layers=size.t5_layers,
                    num_heads=size.t5_heads,
                    relative_attention_num_buckets=32,
                    feed_forward_proj="gated-gelu",
                    pad_token_id=0,
                )
            )
            transformer = FluxTransformer2DModel(  # type: ignore[no-untyped-call]
                patch_size=1,
                in_channels=size.latent_channels * 4,
                num_layers=size.double_blocks,
                num_single_layers=size.single_blocks,
                attention_head_dim=size.head_dim,
                num_attention_heads=size.heads,
                joint_attention_dim=size.t5_dim,
                pooled_projection_dim=size.clip_dim,
                axes_dims_rope=size.axes_rope,
            )
            vae = AutoencoderKL(  # type: ignore[no-untyped-call]
                in_channels=3,
                out_channels=3,
                block_out_channels=size.vae_channels,
                down_block_types=("DownEncoderBlock2D",) * len(size.vae_channels),
                up_block_types=("UpDecoderBlock2D",) * len(size.vae_channels),
                latent_channels=size.latent_channels,
                norm_num_groups=8 if size is not FULL else 32,
                use_quant_conv=False,
                use_post_quant_conv=False,
                shift_factor=0.0609,
                scaling_factor=1.5035,
            )
    finally:
        torch.set_default_dtype(previous)
    modules: tuple[Any, ...] = (clip, t5, transformer, vae)
    for module in modules:
        module.eval()  # as from_pretrained leaves them: no dropout
    pipe = FluxPipeline(  # type: ignore[no-untyped-call]
        scheduler=FlowMatchEulerDiscreteScheduler(),  # type: ignore[no-untyped-call]
        vae=vae,
        text_encoder=clip,
        tokenizer=clip_tokenizer,
        text_encoder_2=t5,
        tokenizer_2=t5_tokenizer,
        transformer=transformer,
    )
    pipe.set_progress_bar_config(disable=True)  # type: ignore[attr-defined]
    return pipe
