"""STAND-IN of ``vllm.engine.arg_utils``: the engine arguments the worker passes (as flags)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, fields
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from vllm.usage.usage_lib import UsageContext

KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
DEFAULT_MAX_NUM_SEQS = 256


@dataclass
class AsyncEngineArgs:
    """The engine arguments vLLM 0.24 has of those the worker sets (a subset of its fields)."""

    model: str = "facebook/opt-125m"
    served_model_name: list[str] | None = None
    gpu_memory_utilization: float = 0.9
    enable_sleep_mode: bool = False
    enforce_eager: bool = False
    skip_tokenizer_init: bool = False
    seed: int = 0
    max_model_len: int | None = None
    dtype: str = "auto"
    attention_backend: str | None = None
    tensor_parallel_size: int = 1
    max_num_seqs: int | None = None
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool | None = None
    enable_chunked_prefill: bool | None = None
    disable_log_stats: bool = False
    enable_log_requests: bool = False
    reasoning_parser: str = ""  # vLLM's StructuredOutputsConfig.reasoning_parser
    worker_extension_cls: str = ""  # vLLM's ParallelConfig.worker_extension_cls

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        bool_opt = argparse.BooleanOptionalAction
        parser.add_argument("--model", default="facebook/opt-125m")
        parser.add_argument("--served-model-name", nargs="+", default=None)
        parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
        parser.add_argument("--enable-sleep-mode", action=bool_opt, default=False)
        parser.add_argument("--enforce-eager", action=bool_opt, default=False)
        parser.add_argument("--skip-tokenizer-init", action=bool_opt, default=False)
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--max-model-len", type=int, default=None)
        parser.add_argument(
            "--dtype",
            default="auto",
            choices=["auto", "half", "float16", "bfloat16", "float", "float32"],
        )
        parser.add_argument("--attention-backend", default=None)
        parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
        parser.add_argument("--max-num-seqs", type=int, default=None)
        parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
        parser.add_argument("--enable-prefix-caching", action=bool_opt, default=None)
        parser.add_argument("--enable-chunked-prefill", action=bool_opt, default=None)
        parser.add_argument("--disable-log-stats", action="store_true", default=False)
        parser.add_argument("--enable-log-requests", action=bool_opt, default=False)
        parser.add_argument("--reasoning-parser", default="")
        parser.add_argument("--worker-extension-cls", default="")
        return parser  # fmt: skip

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> AsyncEngineArgs:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    def create_engine_config(self, usage_context: UsageContext | None = None) -> SimpleNamespace:
        """The resolved configuration (``VllmConfig``'s parts the worker and app read)."""
        if self.tensor_parallel_size != 1:
            raise NotImplementedError("the stand-in engine runs on one simulated device")
        config = json.loads((Path(self.model) / "config.json").read_text())
        limit = int(config.get("max_position_embeddings", 2048))
        max_len = self.max_model_len or limit
        if max_len > limit:
            raise ValueError(
                f"User-specified max_model_len ({max_len}) is greater than the derived "
                f"max_model_len (max_position_embeddings={limit} in model's config.json)."
            )
        names = self.served_model_name or [self.model]
        model_config = SimpleNamespace(
            model=self.model,
            served_model_name=names[0],
            max_model_len=max_len,
            skip_tokenizer_init=self.skip_tokenizer_init,
            enable_sleep_mode=self.enable_sleep_mode,
            seed=self.seed,
        )
        return SimpleNamespace(
            model_config=model_config,
            cache_config=SimpleNamespace(
                gpu_memory_utilization=self.gpu_memory_utilization,
                cache_dtype=self.kv_cache_dtype,
                enable_prefix_caching=(
                    True if self.enable_prefix_caching is None else self.enable_prefix_caching
                ),
            ),
            scheduler_config=SimpleNamespace(
                max_num_seqs=self.max_num_seqs or DEFAULT_MAX_NUM_SEQS,
                enable_chunked_prefill=(
                    True if self.enable_chunked_prefill is None else self.enable_chunked_prefill
                ),
            ),
            parallel_config=SimpleNamespace(
                tensor_parallel_size=self.tensor_parallel_size,
                worker_extension_cls=self.worker_extension_cls,
            ),
            compilation_config=SimpleNamespace(enforce_eager=self.enforce_eager),
            lora_config=None,
            structured_outputs_config=SimpleNamespace(reasoning_parser=self.reasoning_parser),
            engine_args=self,
            usage_context=usage_context,
        )

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
