"""Bounds on what one request may ask of a stage, checked before it is held or queued.

The operator sets them from ``spec.limits`` (worker flags ``--max-request-bytes``,
``--max-prompt-tokens``, ``--max-image-side``, ``--max-frames``). The defaults keep one request
within what a stage's measured footprint covers: a prompt of 8192 tokens, an image side of 2048
pixels, 129 video frames, a 1 MiB body (an 8192-token prompt is some 40 KB of JSON).

A refusal is :class:`OverLimit` naming the GenerateRequest field (gRPC INVALID_ARGUMENT;
HTTP 400 naming the OpenAI parameter behind it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from omnistage.worker.v1 import inference_service_pb2

MI: Final = 1024 * 1024
DEFAULT_REQUEST_BODY_BYTES: Final = 1 * MI
DEFAULT_PROMPT_TOKENS: Final = 8192
DEFAULT_IMAGE_SIDE: Final = 2048
DEFAULT_FRAMES: Final = 129


class OverLimit(ValueError):
    """A request over a bound; ``field`` names the GenerateRequest field (as InvalidRequest)."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field


@dataclass(frozen=True)
class RequestLimits:
    """The bounds of one worker (all at least 1)."""

    request_body_bytes: int = DEFAULT_REQUEST_BODY_BYTES
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS
    image_side: int = DEFAULT_IMAGE_SIDE
    frames: int = DEFAULT_FRAMES

    def invalid(self) -> tuple[str, str] | None:
        """(flag, reason) of the first bound below 1, else None."""
        for flag, value in (
            ("--max-request-bytes", self.request_body_bytes),
            ("--max-prompt-tokens", self.prompt_tokens),
            ("--max-image-side", self.image_side),
            ("--max-frames", self.frames),
        ):
            if value < 1:
                return flag, f"{value} (at least 1)"
        return None


def model_length(runner: Any) -> int | None:
    """The context length of an AR runner's model (None: not known)."""
    config = getattr(getattr(runner, "model", None), "config", None)
    length = getattr(config, "max_position_embeddings", None)
    return length if isinstance(length, int) and length > 0 else None


def prompt_tokens(runner: Any, prompt: str) -> int | None:
    """How many tokens the runner's tokenizer makes of ``prompt`` (None: no tokenizer)."""
    tokenizer = getattr(runner, "tokenizer", None)
    if tokenizer is None or not callable(tokenizer):
        return None
    return len(tokenizer(prompt)["input_ids"])


def check_text(
    limits: RequestLimits,
    request: inference_service_pb2.GenerateRequest,
    prompt_len: int | None,
    model_len: int | None,
) -> None:
    """The prompt within ``--max-prompt-tokens`` and the model's length, and ``max_new_tokens``
    within what the model's length leaves after the prompt."""
    if prompt_len is None:
        return
    if prompt_len > limits.prompt_tokens:
        raise OverLimit(
            "prompt", f"{prompt_len} tokens is above this stage's limit of {limits.prompt_tokens}"
        )
    if model_len is None:
        return
    room = model_len - prompt_len
    if room < 1:
        raise OverLimit(
            "prompt", f"{prompt_len} tokens leave no room in the model's length of {model_len}"
        )
    if request.max_new_tokens > room:
        raise OverLimit(
            "max_new_tokens",
            f"{request.max_new_tokens} is more than the {room} tokens the model's length of "
            f"{model_len} leaves after the prompt's {prompt_len}",
        )


def check_media(limits: RequestLimits, request: inference_service_pb2.GenerateRequest) -> None:
    """Image sides within ``--max-image-side`` and frames within ``--max-frames``."""
    for name, value in (("width", request.width), ("height", request.height)):
        if value > limits.image_side:
            raise OverLimit(
                name, f"{value} pixels is above this stage's limit of {limits.image_side}"
            )
    if request.num_frames > limits.frames:
        raise OverLimit(
            "num_frames", f"{request.num_frames} is above this stage's limit of {limits.frames}"
        )


def check(
    limits: RequestLimits, request: inference_service_pb2.GenerateRequest, runner: Any
) -> None:
    """Every bound that applies to ``request`` on ``runner``."""
    check_media(limits, request)
    check_text(limits, request, prompt_tokens(runner, request.prompt), model_length(runner))
