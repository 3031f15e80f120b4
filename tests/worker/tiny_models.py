"""Tiny real models built from configs and saved with ``save_pretrained`` (nothing downloaded)."""

from __future__ import annotations

import json
import string
from pathlib import Path

import torch

SENTENCES = [
    "the cat sat on the mat",
    "a dog ran in the park",
    "the sun is bright today",
    "we like to read books",
    "a bird can fly over the tree",
]


def write_clip_tokenizer(directory: Path) -> None:
    """A CLIP BPE tokenizer over single letters (vocab.json + merges.txt written here)."""
    from transformers import CLIPTokenizer

    directory.mkdir(parents=True, exist_ok=True)
    vocab: dict[str, int] = {}
    for token in ["<|startoftext|>", "<|endoftext|>", "!"]:
        vocab[token] = len(vocab)
    for ch in string.ascii_lowercase:
        vocab[ch] = len(vocab)
        vocab[ch + "</w>"] = len(vocab)
    merges = ["#version: 0.2", "t h", "th e</w>"]
    vocab["th"] = len(vocab)
    vocab["the</w>"] = len(vocab)
    (directory / "vocab.json").write_text(json.dumps(vocab))
    (directory / "merges.txt").write_text("\n".join(merges) + "\n")
    tokenizer = CLIPTokenizer(
        vocab_file=str(directory / "vocab.json"),
        merges_file=str(directory / "merges.txt"),
        model_max_length=16,
        pad_token="!",
    )
    tokenizer.save_pretrained(str(directory))


def build_diffusion_pipeline(directory: Path, *, text_intermediate_size: int = 32) -> Path:
    """A tiny Stable-Diffusion-style pipeline (UNet, VAE, CLIP text encoder, DDIM scheduler);
    ``text_intermediate_size`` sets the text encoder's MLP width (a large one makes the encoder
    the pipeline's largest component)."""
    from diffusers import (
        AutoencoderKL,
        DDIMScheduler,
        StableDiffusionPipeline,
        UNet2DConditionModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    torch.manual_seed(0)
    tok_dir = directory.parent / (directory.name + "-tokenizer-src")
    write_clip_tokenizer(tok_dir)
    tokenizer = CLIPTokenizer.from_pretrained(str(tok_dir))
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=16,
            intermediate_size=text_intermediate_size,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=16,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=2,
        )
    )
    unet = UNet2DConditionModel(  # type: ignore[no-untyped-call]
        sample_size=8,
        in_channels=4,
        out_channels=4,
        block_out_channels=(16, 32),
        layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=16,
        attention_head_dim=4,
        norm_num_groups=8,
    )
    vae = AutoencoderKL(  # type: ignore[no-untyped-call]
        in_channels=3,
        out_channels=3,
        block_out_channels=(8, 16),
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        latent_channels=4,
        norm_num_groups=8,
        sample_size=16,
    )
    scheduler = DDIMScheduler(  # type: ignore[no-untyped-call]
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        steps_offset=1,
    )
    pipe = StableDiffusionPipeline(  # type: ignore[no-untyped-call]
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.save_pretrained(str(directory), safe_serialization=True)  # type: ignore[attr-defined]
    return directory


def build_causal_lm(
    directory: Path,
    hidden_size: int = 32,
    intermediate_size: int = 64,
    num_hidden_layers: int = 2,
) -> Path:
    """A tiny Llama with a WordLevel tokenizer trained on a few sentences."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    raw = Tokenizer(models.WordLevel(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>", "<pad>"])
    raw.train_from_iterator(SENTENCES, trainer)
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=raw,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(str(directory), safe_serialization=True)
    tokenizer.save_pretrained(str(directory))
    return directory


def word_level_tokenizer(directory: Path) -> Path:
    """A fast WordLevel tokenizer over a few sentences, saved where pipelines load it from."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.WordLevelTrainer(special_tokens=["<pad>", "</s>", "<unk>"])
    raw.train_from_iterator(SENTENCES, trainer)
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=raw, unk_token="<unk>", eos_token="</s>", pad_token="<pad>"
    )
    tokenizer.save_pretrained(str(directory))
    return directory


def build_wan_pipeline(directory: Path) -> Path:
    """A tiny Wan text-to-video pipeline (T5 encoder, 3D transformer, Wan VAE)."""
    from diffusers import (
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )
    from transformers import AutoTokenizer, T5Config, T5EncoderModel

    torch.manual_seed(0)
    tok_dir = word_level_tokenizer(directory.parent / (directory.name + "-tokenizer-src"))
    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    text_encoder = T5EncoderModel(
        T5Config(
            vocab_size=len(tokenizer),
            d_model=32,
            d_kv=8,
            d_ff=37,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            pad_token_id=0,
        )
    )
    transformer = WanTransformer3DModel(  # type: ignore[no-untyped-call]
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=16,
        out_channels=16,
        text_dim=32,
        freq_dim=256,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )
    vae = AutoencoderKLWan(  # type: ignore[no-untyped-call]
        base_dim=3,
        z_dim=16,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
    )
    pipe = WanPipeline(  # type: ignore[no-untyped-call]
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),  # type: ignore[no-untyped-call]
        transformer=transformer,
    )
    pipe.save_pretrained(str(directory), safe_serialization=True)  # type: ignore[attr-defined]
    return directory


def build_flux_pipeline(directory: Path) -> Path:
    """A tiny Flux pipeline (CLIP and T5 encoders, Flux transformer, VAE), saved."""
    from bench.flux_like import TINY, flux_like

    pipe = flux_like(TINY, directory.parent / (directory.name + "-tokenizers"))
    pipe.save_pretrained(str(directory), safe_serialization=True)
    return directory
