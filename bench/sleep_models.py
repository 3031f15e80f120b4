"""The models ``bench/worker_sleep.py`` measures: a Llama-shaped causal LM of >= 16 GiB and a Flux
transformer of >= 8 GiB (``--tiny``: tiny ones), built from configs with random bf16 weights and
saved as safetensors, their plain ``load_file`` time, and each loaded as the worker's runners do
with a fixed-input forward for exactness checks."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.sleep_limits import device, gbps, timed

MiB = 1024**2
Json = dict[str, Any]


def llm_config(tiny: bool) -> Any:
    from transformers import LlamaConfig

    if tiny:
        return LlamaConfig(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    from bench.serving_models import llm_config as the_llm

    return the_llm(smoke=False)  # the 16.6 GiB shape, the same for every bench


def dit_kwargs(tiny: bool) -> Json:
    if tiny:
        return {
            "num_layers": 1,
            "num_single_layers": 1,
            "attention_head_dim": 16,
            "num_attention_heads": 2,
            "joint_attention_dim": 32,
            "pooled_projection_dim": 16,
            "in_channels": 16,
            "axes_dims_rope": (4, 6, 6),
        }
    return {"num_layers": 8, "num_single_layers": 16}


def child_build(workdir: Path, tiny: bool) -> Json:
    """Random-weight bf16 models built from configs on the device, saved as safetensors."""
    from transformers import LlamaForCausalLM

    flux = flux_class()
    dev = device()
    out: Json = {}
    torch.set_default_dtype(torch.bfloat16)
    torch.manual_seed(0)
    llm_dir = workdir / "llm"
    if not (llm_dir / "config.json").exists():
        with dev:
            model = LlamaForCausalLM(llm_config(tiny))
        start = time.perf_counter()
        model.save_pretrained(llm_dir, max_shard_size="4GB")
        out["llm_save_seconds"] = time.perf_counter() - start
        del model
    dit_dir = workdir / "dit"
    if not (dit_dir / "config.json").exists():
        with dev:
            dit = flux(**dit_kwargs(tiny))
        start = time.perf_counter()
        dit.save_pretrained(dit_dir, max_shard_size="4GB")
        out["dit_save_seconds"] = time.perf_counter() - start
        del dit
    for name, path in (("llm", llm_dir), ("dit", dit_dir)):
        files = sorted(path.glob("*.safetensors"))
        out[f"{name}_file_bytes"] = sum(f.stat().st_size for f in files)
    return out


def flux_class() -> Any:
    """diffusers' Flux transformer class (untyped upstream)."""
    import diffusers

    return diffusers.FluxTransformer2DModel


def child_baseline(model_dir: Path) -> Json:
    """Plain ``safetensors.torch.load_file(device=...)`` of the model's files (page cache warm)."""
    from safetensors.torch import load_file

    dev = device()
    torch.zeros(1, device=dev)
    files = sorted(model_dir.glob("*.safetensors"))
    nbytes = sum(f.stat().st_size for f in files)
    for f in files:  # make sure the page cache holds the files, as it does for the worker's wake
        with f.open("rb") as fh:
            while fh.read(64 * MiB):
                pass
    runs = []
    holder: list[dict[str, torch.Tensor]] = []
    for _ in range(2):
        runs.append(timed(lambda: holder.extend(load_file(f, device=str(dev)) for f in files)))
        holder.clear()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    best = min(runs)
    return {"bytes": nbytes, "seconds": best, "gbps": gbps(nbytes, best)}


def load_model(kind: str, model_dir: Path) -> tuple[torch.nn.Module, Callable[[], torch.Tensor]]:
    """Load like the worker's runners (on CPU), and a fixed-input forward for exactness checks."""
    if kind == "llm":
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.bfloat16)
        model.train(False)
        vocab = int(model.config.vocab_size)

        def forward() -> torch.Tensor:
            ids = (torch.arange(64, device=device()).reshape(1, 64) * 7919) % vocab
            with torch.inference_mode():
                logits: torch.Tensor = model(input_ids=ids).logits.float().clone()
            return logits

        return model, forward
    dit = flux_class().from_pretrained(model_dir, torch_dtype=torch.bfloat16)
    dit.train(False)
    cfg = dit.config
    gen = torch.Generator().manual_seed(1)
    img, txt = 256, 32
    inputs = {
        "hidden_states": torch.randn(1, img, cfg.in_channels, generator=gen),
        "encoder_hidden_states": torch.randn(1, txt, cfg.joint_attention_dim, generator=gen),
        "pooled_projections": torch.randn(1, cfg.pooled_projection_dim, generator=gen),
        "timestep": torch.tensor([0.5]),
        "img_ids": torch.zeros(img, 3),
        "txt_ids": torch.zeros(txt, 3),
    }

    def forward_dit() -> torch.Tensor:
        args = {k: v.to(device(), torch.bfloat16) for k, v in inputs.items()}
        with torch.inference_mode():
            sample: torch.Tensor = dit(**args, return_dict=False)[0].float().clone()
        return sample

    return dit, forward_dit
