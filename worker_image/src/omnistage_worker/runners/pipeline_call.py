"""What a diffusers pipeline's ``__call__`` accepts: the parameter map and the size rules.

Pure logic over a call signature and a few pipeline facts, so it is tested without a pipeline.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omnistage_worker.runners.base import InvalidRequest

Scalar = bool | int | float | str

REQUEST_FIELDS = frozenset(
    {"prompt", "num_inference_steps", "height", "width", "guidance_scale", "num_frames"}
)
"""Arguments the request sets through its own fields."""

RESERVED = frozenset(
    {
        "generator",
        "output_type",
        "return_dict",
        "num_images_per_prompt",
        "num_videos_per_prompt",
        "callback",
        "callback_steps",
        "callback_on_step_end",
        "callback_on_step_end_tensor_inputs",
        "cross_attention_kwargs",
        "joint_attention_kwargs",
        "attention_kwargs",
    }
)
"""Arguments the worker owns (one seeded output per request) or that are not scalars."""

_TENSOR_WORDS = ("embeds", "latents", "image", "mask", "timesteps", "sigmas", "video")


@dataclass(frozen=True)
class SizeRules:
    """What sizes a pipeline accepts: side multiples and the frame-count step (video)."""

    side_multiple: int
    frame_step: int | None = None
    """Video: ``num_frames - 1`` must be a multiple of it (None: no frames, an image pipeline)."""


def size_rules(pipeline_class: str, facts: Mapping[str, int | None]) -> SizeRules:
    """The rules each family's ``check_inputs`` enforces (``facts``: the pipeline's attributes
    ``vae_scale_factor``, ``vae_scale_factor_spatial``, ``vae_scale_factor_temporal``,
    ``patch_size``; None where the pipeline lacks one)."""
    vae = facts.get("vae_scale_factor") or facts.get("vae_scale_factor_spatial") or 8
    temporal = facts.get("vae_scale_factor_temporal")
    if pipeline_class.startswith(("Flux", "QwenImage")):  # 2x2 packed latents
        return SizeRules(vae * 2)
    if pipeline_class.startswith("StableDiffusion3"):
        return SizeRules(vae * (facts.get("patch_size") or 2))
    if pipeline_class.startswith("Wan"):
        return SizeRules(16, temporal or 4)
    return SizeRules(vae, temporal)


def check_sizes(rules: SizeRules, height: int, width: int, num_frames: int, video: bool) -> None:
    """Refuse sizes the pipeline would refuse or silently change (0: the pipeline's default)."""
    for field, value in (("height", height), ("width", width)):
        if value and value % rules.side_multiple:
            raise InvalidRequest(field, f"{value} is not a multiple of {rules.side_multiple}")
    if not num_frames:
        return
    if not video:
        raise InvalidRequest("num_frames", "this pipeline makes images, not videos")
    step = rules.frame_step or 1
    if (num_frames - 1) % step:
        raise InvalidRequest("num_frames", f"{num_frames} - 1 is not a multiple of {step}")


def _accepts(annotation: Any, default: Any, value: Scalar) -> bool:
    """Whether ``value`` fits a parameter, judged by its default's type, else its annotation."""
    kinds: dict[type, tuple[type, ...]] = {
        bool: (bool,),
        int: (int,),
        float: (int, float),
        str: (str,),
    }
    if isinstance(default, bool | int | float | str):
        allowed = kinds[type(default)]
        return isinstance(value, allowed) and not (
            isinstance(value, bool) and not isinstance(default, bool)
        )
    if annotation is inspect.Parameter.empty:
        return True
    text = str(annotation)
    names = {bool: "bool", int: "int", float: "float", str: "str"}
    if isinstance(value, bool):
        return "bool" in text
    if isinstance(value, int):
        return "int" in text or "float" in text
    return names[type(value)] in text


def check_parameters(
    signature: inspect.Signature, owner: str, parameters: Mapping[str, Scalar]
) -> dict[str, Scalar]:
    """The keyword arguments for the call, or :class:`InvalidRequest` naming the parameter."""
    accepted: dict[str, Scalar] = {}
    for name, value in sorted(parameters.items()):
        field = f"parameters[{name}]"
        if name in REQUEST_FIELDS:
            raise InvalidRequest(field, f"set it with the request's {name} field")
        if name in RESERVED or name.endswith(_TENSOR_WORDS):
            raise InvalidRequest(field, "is set by the worker or takes tensors; not accepted")
        param = signature.parameters.get(name)
        if param is None or param.kind not in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
            raise InvalidRequest(field, f"{owner} has no parameter {name!r}")
        if not _accepts(param.annotation, param.default, value):
            raise InvalidRequest(
                field, f"{type(value).__name__} does not fit {owner}'s {name} ({param})"
            )
        widen = isinstance(param.default, float) and isinstance(value, int)
        accepted[name] = float(value) if widen else value
    return accepted
