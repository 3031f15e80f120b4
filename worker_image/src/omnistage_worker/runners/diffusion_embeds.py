"""Prompt embeds into a diffusers pipeline: what it takes, checked per request, stacked per batch.

A pipeline stage after an encoder stage gets ``GenerateRequest.prompt_embeds`` instead of a
prompt (:mod:`omnistage_worker.runners.embeds` carries them); they go to the pipeline's
``prompt_embeds`` (and ``prompt_embeds_mask`` where it takes one, as Qwen-Image does).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

from omnistage.worker.v1 import inference_service_pb2
from omnistage_worker.runners.base import InvalidRequest
from omnistage_worker.runners.embeds import FIELD, MASK, EmbedsShape, check_header, stack, unpack

Request = inference_service_pb2.GenerateRequest


def absent_components(model_dir: Path) -> list[str]:
    """Components ``model_index.json`` saves as absent (``[null, null]``): a pipeline stage
    whose text encoder is another stage loads without it."""
    try:
        index = json.loads((model_dir / "model_index.json").read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(index, dict):
        return []
    return sorted(k for k, v in index.items() if v == [None, None])


def embeds_width(pipeline: Any) -> int | None:
    """The hidden width the pipeline's denoiser attends to (None: not known)."""
    for name, key in (
        ("transformer", "joint_attention_dim"),
        ("unet", "cross_attention_dim"),
        ("transformer", "text_dim"),
    ):
        config = getattr(getattr(pipeline, name, None), "config", None)
        width = getattr(config, key, None) if config is not None else None
        if isinstance(width, int):
            return width
    return None


def check_embeds(
    request: Request, owner: str, params: Collection[str], width: int | None, limit: int
) -> EmbedsShape | None:
    """The shape of the request's embeds once they fit the pipeline (None: it has a prompt)."""
    if not request.HasField("prompt_embeds"):
        return None
    if FIELD not in params:
        raise InvalidRequest(FIELD, f"{owner} does not take prompt embeds")
    if request.prompt:
        raise InvalidRequest(FIELD, "give a prompt or prompt embeds, not both")
    shape = check_header(request.prompt_embeds, limit)
    if width is not None and shape.hidden != width:
        raise InvalidRequest(FIELD, f"hidden width {shape.hidden} is not {owner}'s {width}")
    _, mask = unpack(request.prompt_embeds, limit)
    if MASK not in params and not bool(mask.all()):
        raise InvalidRequest(FIELD, f"{owner} takes no mask; padded embeds would be attended")
    return shape


def batch_key(request: Request) -> tuple[int, int, str] | None:
    """What requests with embeds share to run in one call: their shape (no padding)."""
    if not request.HasField("prompt_embeds"):
        return None
    e = request.prompt_embeds
    return (*[int(d) for d in e.shape], e.dtype)  # type: ignore[return-value]


def call_arguments(
    requests: Sequence[Request], params: Collection[str], device: Any, dtype: Any, limit: int
) -> dict[str, Any]:
    """``prompt_embeds`` (and ``prompt_embeds_mask``) of one call, on the pipeline's device and
    in its dtype; single requests unbatched, as a prompt would be."""
    embeds, mask = stack([unpack(r.prompt_embeds, limit) for r in requests])
    arguments: dict[str, Any] = {FIELD: embeds.to(device=device, dtype=dtype)}
    if MASK in params:
        arguments[MASK] = mask.to(device=device)
    return arguments
