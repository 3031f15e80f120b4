"""Flag groups of ``omnistage-worker`` and the config parts they make: the request limits
(``spec.limits``, ``spec.http``) and the vLLM engine arguments (``--backend vllm``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from omnistage_worker.config import VllmArgs, parse_byte_flag
from omnistage_worker.limits import (
    DEFAULT_FRAMES,
    DEFAULT_IMAGE_SIDE,
    DEFAULT_PROMPT_TOKENS,
    DEFAULT_REQUEST_BODY_BYTES,
    RequestLimits,
)


def limit_flags(p: argparse.ArgumentParser) -> None:
    """Bounds on one request and the HTTP API's token (the operator's ``spec.limits``,
    ``spec.http``); see :mod:`omnistage_worker.limits`."""
    g = p.add_argument_group("request limits and HTTP auth")
    g.add_argument(
        "--max-request-bytes",
        default=str(DEFAULT_REQUEST_BODY_BYTES),
        help="largest HTTP request body (a quantity, default 1Mi): larger ones get 413",
    )
    g.add_argument("--max-prompt-tokens", type=int, default=DEFAULT_PROMPT_TOKENS)
    g.add_argument("--max-image-side", type=int, default=DEFAULT_IMAGE_SIDE, help="pixels")
    g.add_argument("--max-frames", type=int, default=DEFAULT_FRAMES, help="video frames")
    g.add_argument(
        "--http-token-file",
        type=Path,
        help="bearer token the OpenAI HTTP API requires (/health stays open; default: none)",
    )


def request_limits(args: argparse.Namespace) -> RequestLimits:
    """The limit flags as :class:`RequestLimits` (validated with the rest of the config)."""
    return RequestLimits(
        request_body_bytes=parse_byte_flag(args.max_request_bytes, "--max-request-bytes"),
        prompt_tokens=args.max_prompt_tokens,
        image_side=args.max_image_side,
        frames=args.max_frames,
    )


def vllm_flags(p: argparse.ArgumentParser) -> None:
    """vLLM engine arguments (``--backend vllm`` only); see ``config.VllmArgs``."""
    g = p.add_argument_group("vLLM engine (--backend vllm)")
    g.add_argument("--vllm-max-model-len", type=int, help="context length (max_model_len)")
    g.add_argument(
        "--vllm-gpu-memory-utilization",
        type=float,
        help="vLLM's share of each device (default: --vllm-memory-bytes over the device total)",
    )
    g.add_argument(
        "--vllm-memory-bytes",
        help="the stage's device memory (a quantity, summed over its devices): the default "
        "gpu_memory_utilization is this over the device's total",
    )
    g.add_argument("--vllm-enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument("--vllm-tensor-parallel-size", type=int, default=1)
    g.add_argument("--vllm-attention-backend", help="e.g. TRITON_ATTN (vLLM's attention_backend)")
    g.add_argument(
        "--vllm-max-num-seqs", type=int, help="most sequences in one batch (max_num_seqs)"
    )
    g.add_argument("--vllm-kv-cache-dtype", help="KV cache dtype (kv_cache_dtype: auto, fp8, ...)")
    g.add_argument(
        "--vllm-enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        help="prefix caching (default: vLLM's)",
    )
    g.add_argument(
        "--vllm-enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        help="chunked prefill (default: vLLM's)",
    )
    g.add_argument(
        "--vllm-enable-auto-tool-choice", action="store_true", help="tool calls (needs a parser)"
    )
    g.add_argument("--vllm-tool-call-parser", help="vLLM's tool_call_parser, e.g. hermes")
    g.add_argument("--vllm-reasoning-parser", help="vLLM's reasoning_parser, e.g. deepseek_r1")
    g.add_argument("--vllm-chat-template", type=Path, help="a Jinja chat template file")
    g.add_argument(
        "--no-vllm-fast-wake",
        dest="vllm_fast_wake",
        action="store_false",
        help="sleep and wake through vLLM's own CuMemAllocator methods (default: the worker's "
        "extension keeps the host copy and overlaps the copies with the KV cache's mapping)",
    )


def vllm_args(args: argparse.Namespace) -> VllmArgs:
    """The ``--vllm-*`` flags as :class:`VllmArgs` (validated with the rest of the config)."""
    memory = args.vllm_memory_bytes
    return VllmArgs(
        max_model_len=args.vllm_max_model_len,
        gpu_memory_utilization=args.vllm_gpu_memory_utilization,
        memory_bytes=None if memory is None else parse_byte_flag(memory, "--vllm-memory-bytes"),
        enforce_eager=args.vllm_enforce_eager,
        tensor_parallel_size=args.vllm_tensor_parallel_size,
        attention_backend=args.vllm_attention_backend,
        max_num_seqs=args.vllm_max_num_seqs,
        kv_cache_dtype=args.vllm_kv_cache_dtype,
        enable_prefix_caching=args.vllm_enable_prefix_caching,
        enable_chunked_prefill=args.vllm_enable_chunked_prefill,
        enable_auto_tool_choice=args.vllm_enable_auto_tool_choice,
        tool_call_parser=args.vllm_tool_call_parser,
        reasoning_parser=args.vllm_reasoning_parser,
        chat_template=args.vllm_chat_template,
        fast_wake=args.vllm_fast_wake,
    )
