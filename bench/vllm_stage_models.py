"""The models ``bench/vllm_stage.py`` builds: a Llama-architecture causal LM of ~8.4 GiB from a
config with random bf16 weights (safetensors + config.json, no tokenizer) for the vLLM stage, and
a smaller one with a local tokenizer for the torch stage (``--smoke``: tiny, the stand-in's)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.worker_grpc import ensure_tokenizer

Json = dict[str, Any]
GiB = 1024**3

# A Llama of ~8.4 GiB in bf16 (GQA 32/8 heads): 24 layers of 4096 x 11008, vocab 32000.
LLM_CONFIG: Json = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 24,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def llama_shapes(cfg: Json) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes of a Llama checkpoint as transformers and vLLM load it."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = h * cfg["num_key_value_heads"] // cfg["num_attention_heads"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes |= {
            p + "self_attn.q_proj.weight": (h, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
    shapes |= {"model.norm.weight": (h,), "lm_head.weight": (v, h)}
    return shapes


def write_llama(directory: Path, cfg: Json, shard_bytes: int = 2 * GiB) -> Json:
    """Random bf16 weights (norms: ones) in safetensors shards with an index, and config.json."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=dev).manual_seed(0)
    shards: list[dict[str, Any]] = [{}]
    size = 0
    total = 0
    for name, shape in llama_shapes(cfg).items():
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = (torch.randn(shape, generator=gen, device=dev) * 0.02).to(torch.bfloat16).cpu()
        nbytes = t.numel() * t.element_size()
        if size and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
        total += nbytes
    weight_map: dict[str, str] = {}
    for n, shard in enumerate(shards):
        fname = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / fname), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, fname)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    (directory / "config.json").write_text(json.dumps(cfg))
    return {"dir": str(directory), "bytes": total, "shards": len(shards)}


def child_build(workdir: Path, smoke: bool, torch_layers: int) -> Json:
    """The vLLM model (no tokenizer) and the torch model (with a local tokenizer); models
    already built there (a warm machine keeps /tmp) are reused."""
    built = workdir / "built.json"
    if built.exists():
        done: Json = json.loads(built.read_text())
        if done.get("smoke") == smoke and done.get("torch_layers") == torch_layers:
            return done
    if smoke:
        from tests.fakevllm.models import build_standin_model

        llm = build_standin_model(workdir / "vllm_llm", weights=400_000)
        torch_cfg = {**LLM_CONFIG, "hidden_size": 64, "intermediate_size": 128,
                     "num_hidden_layers": 2, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "vocab_size": 256}  # fmt: skip
        out: Json = {"vllm": {"dir": str(llm), "bytes": weights_of(llm)}}
    else:
        out = {"vllm": write_llama(workdir / "vllm_llm", LLM_CONFIG)}
        torch_cfg = {**LLM_CONFIG, "num_hidden_layers": torch_layers}
    out["torch"] = write_llama(workdir / "torch_llm", torch_cfg)
    ensure_tokenizer(workdir / "torch_llm")
    out |= {"smoke": smoke, "torch_layers": torch_layers}
    built.write_text(json.dumps(out))
    return out


def weights_of(model_dir: Path) -> int:
    return sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
