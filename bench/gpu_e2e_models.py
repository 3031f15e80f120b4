"""The two stages' models of ``bench/gpu_e2e.py``, built in a child process on the GPU with random
bf16 weights from configs: a Llama-style causal LM of about 16.6 GiB and a Stable-Diffusion-3-style
pipeline of about 13 GiB (``--tiny``: tiny ones on CPU)."""

from __future__ import annotations

import importlib
import time
from pathlib import Path
from typing import Any

Json = dict[str, Any]


def build_models(models: Path, tiny: bool, small_sd: bool = False) -> Json:
    """The LLM and the SD3-style pipeline, random bf16 weights, built on the device, saved
    (``small_sd``: the pipeline in its tiny configuration, for runs about the LLM alone)."""
    import torch

    from bench.sleep_models import llm_config
    from tests.worker.tiny_models import build_causal_lm

    dev = torch.device("cuda:0" if torch.cuda.is_available() and not tiny else "cpu")
    out: Json = {}
    llm = models / "llm"
    if not (llm / ".done").exists():
        start = time.monotonic()
        build_causal_lm(llm)  # its tokenizer (a WordLevel vocabulary) and a tiny model
        if not tiny:
            from transformers import LlamaForCausalLM

            for f in llm.glob("*.safetensors"):
                f.unlink()
            torch.set_default_dtype(torch.bfloat16)
            torch.manual_seed(0)
            with dev:
                model = LlamaForCausalLM(llm_config(False))
            model.save_pretrained(llm, max_shard_size="4GB")
            del model
            torch.set_default_dtype(torch.float32)
        (llm / ".done").write_text("")
        out["llm_build_seconds"] = round(time.monotonic() - start, 1)
    sd = models / "sd"
    if not (sd / ".done").exists():
        start = time.monotonic()
        build_sd3(sd, dev, tiny or small_sd)
        (sd / ".done").write_text("")
        out["sd_build_seconds"] = round(time.monotonic() - start, 1)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    for name, path in (("llm", llm), ("sd", sd)):
        out[f"{name}_weight_bytes"] = sum(f.stat().st_size for f in path.rglob("*.safetensors"))
    out["sd_components"] = {
        d.name: sum(f.stat().st_size for f in d.glob("*.safetensors"))
        for d in sorted(sd.iterdir())
        if d.is_dir() and any(d.glob("*.safetensors"))
    }
    return out


def build_sd3(directory: Path, dev: Any, tiny: bool) -> None:
    """A Stable-Diffusion-3-style pipeline: CLIP-L and CLIP-G-sized text encoders, a two-layer
    T5 encoder of width 4096 with a word-level tokenizer, an MMDiT transformer (30 blocks of
    width 2304, about 10.7 GiB in bf16) and a 16-channel VAE: about 13 GiB in all."""
    import torch
    from transformers import (
        CLIPTextConfig,
        CLIPTextModelWithProjection,
        CLIPTokenizer,
        T5Config,
        T5EncoderModel,
    )

    from tests.worker.tiny_models import build_causal_lm, write_clip_tokenizer

    diffusers: Any = importlib.import_module("diffusers")  # untyped upstream

    torch.manual_seed(0)
    tok_src = directory.parent / "sd-tokenizer-src"
    write_clip_tokenizer(tok_src)
    tokenizer = CLIPTokenizer.from_pretrained(str(tok_src), model_max_length=77)
    t5_src = directory.parent / "sd-t5-tokenizer-src"
    build_causal_lm(t5_src)  # a word-level fast tokenizer (its tiny model is not used)
    from transformers import AutoTokenizer

    t5_tokenizer = AutoTokenizer.from_pretrained(str(t5_src))
    if tiny:
        dims = [(16, 2, 2), (24, 2, 2)]  # hidden, layers, heads of each text encoder
        t5: Json = {"d_model": 64, "d_ff": 128, "num_layers": 1, "num_heads": 2, "d_kv": 32}
        mmdit: Json = {
            "num_layers": 2,
            "attention_head_dim": 8,
            "num_attention_heads": 2,
            "joint_attention_dim": 64,
            "caption_projection_dim": 16,
            "pooled_projection_dim": 40,
            "sample_size": 8,
            "pos_embed_max_size": 16,
        }
        vae_blocks: tuple[int, ...] = (8, 16)
    else:
        dims = [(768, 12, 12), (1280, 32, 20)]
        t5 = {"d_model": 4096, "d_ff": 10240, "num_layers": 2, "num_heads": 64, "d_kv": 64}
        mmdit = {
            "num_layers": 30,
            "attention_head_dim": 64,
            "num_attention_heads": 36,
            "joint_attention_dim": 4096,
            "caption_projection_dim": 2304,
            "pooled_projection_dim": 2048,
            "sample_size": 128,
            "pos_embed_max_size": 192,
        }
        vae_blocks = (128, 256, 512, 512)
    dtype = torch.float32 if tiny else torch.bfloat16
    torch.set_default_dtype(dtype)
    encoders = []
    with dev:
        for hidden, layers, heads in dims:
            cfg = CLIPTextConfig(
                vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=4 * hidden,
                num_hidden_layers=layers, num_attention_heads=heads, max_position_embeddings=77,
                projection_dim=hidden, bos_token_id=0, eos_token_id=1, pad_token_id=2,
            )  # fmt: skip
            encoders.append(CLIPTextModelWithProjection(cfg))
        t5_encoder = T5EncoderModel(
            T5Config(vocab_size=len(t5_tokenizer), feed_forward_proj="gated-gelu", **t5)
        )
        transformer = diffusers.SD3Transformer2DModel(
            patch_size=2, in_channels=16, out_channels=16, **mmdit
        )
        vae = diffusers.AutoencoderKL(
            in_channels=3, out_channels=3, latent_channels=16,
            block_out_channels=vae_blocks,
            down_block_types=("DownEncoderBlock2D",) * len(vae_blocks),
            up_block_types=("UpDecoderBlock2D",) * len(vae_blocks),
            norm_num_groups=8 if tiny else 32, use_quant_conv=False, use_post_quant_conv=False,
            scaling_factor=1.5305, shift_factor=0.0609,
        )  # fmt: skip
    torch.set_default_dtype(torch.float32)
    pipe = diffusers.StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=vae,
        text_encoder=encoders[0],
        tokenizer=tokenizer,
        text_encoder_2=encoders[1],
        tokenizer_2=tokenizer,
        text_encoder_3=t5_encoder,
        tokenizer_3=t5_tokenizer,
    )
    pipe.save_pretrained(str(directory), safe_serialization=True, max_shard_size="4GB")
