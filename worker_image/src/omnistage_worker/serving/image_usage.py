"""``usage`` of an images answer, in the OpenAI images API's shape.

A diffusion stage reads a prompt and makes no tokens, so: ``input_tokens`` (all
``text_tokens``) is the prompt as the pipeline's first tokenizer counts it, once per request
whatever ``n``; ``output_tokens`` is 0; ``total_tokens`` their sum. Two fields of its own say
what the answer cost: ``images`` (how many were made) and ``steps`` (denoising steps per image:
the request's ``num_inference_steps``, else the pipeline's default).
"""

from __future__ import annotations

import inspect
from typing import Any

from omnistage.worker.v1 import inference_service_pb2

JSON = dict[str, Any]


def image_usage(runner: Any, request: inference_service_pb2.GenerateRequest, images: int) -> JSON:
    """The ``usage`` of ``images`` made for ``request`` by ``runner`` (a diffusion runner)."""
    pipeline = getattr(runner, "pipeline", None)
    steps = request.num_inference_steps or default_steps(pipeline)
    return usage_of_images(prompt_tokens(pipeline, request.prompt), images, steps)


def usage_of_images(prompt: int, images: int, steps: int) -> JSON:
    """The images API's ``usage`` for ``images`` made from a ``prompt``-token prompt, plus ours:
    ``images`` and ``steps`` (denoising steps per image)."""
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"text_tokens": prompt, "image_tokens": 0},
        "output_tokens": 0,
        "output_tokens_details": {"text_tokens": 0, "image_tokens": 0},
        "total_tokens": prompt,
        "images": images,
        "steps": steps,
    }


def prompt_tokens(pipeline: Any, prompt: str) -> int:
    """Tokens of ``prompt`` by the pipeline's (first) tokenizer, within its length as the
    pipeline truncates (0: no tokenizer)."""
    tokenizer = getattr(pipeline, "tokenizer", None)
    if tokenizer is None or not callable(tokenizer):
        return 0
    ids = tokenizer(prompt)["input_ids"]
    most = getattr(tokenizer, "model_max_length", None)
    return min(len(ids), most) if isinstance(most, int) and most > 0 else len(ids)


def default_steps(pipeline: Any) -> int:
    """The pipeline's own default ``num_inference_steps`` (0: it has none)."""
    if pipeline is None or not callable(pipeline):
        return 0
    try:
        parameter = inspect.signature(pipeline).parameters.get("num_inference_steps")
    except (TypeError, ValueError):
        return 0
    default = None if parameter is None else parameter.default
    return default if isinstance(default, int) else 0
