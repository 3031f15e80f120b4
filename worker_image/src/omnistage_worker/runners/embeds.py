"""Prompt embeds between the stages of a pipeline: a typed, size-checked safetensors message.

An encoder stage's hidden states travel to a diffusion stage as :class:`PromptEmbeds`: the bytes
of a safetensors file with ``prompt_embeds`` [tokens, hidden] and ``prompt_embeds_mask``
[tokens] (I64), plus the declared shape and dtype. :func:`check_header` checks the length
against the limit and the file's header against the declaration before any tensor is read
(no pickle anywhere); :func:`unpack` then reads the tensors. A misfit is
:class:`InvalidRequest` naming ``prompt_embeds``.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from omnistage.worker.v1 import inference_service_pb2
from omnistage_worker.runners.base import InvalidRequest

if TYPE_CHECKING:
    import torch

FIELD: Final = "prompt_embeds"
MASK: Final = "prompt_embeds_mask"
MAX_EMBEDS_BYTES: Final = 64 * 1024 * 1024
"""The default limit of one message's file (Qwen-Image's 1024 tokens x 3584 in BF16: 7 MiB)."""
MAX_HEADER_BYTES: Final = 64 * 1024
MAX_MESSAGE_BYTES: Final = MAX_EMBEDS_BYTES + 1024 * 1024
"""The gRPC message limit of the worker and the router: the embeds and the request around them."""

ITEM_BYTES: Final = {"F32": 4, "F16": 2, "BF16": 2}
"""The dtypes prompt embeds may have, and their item sizes."""


@dataclass(frozen=True)
class EmbedsShape:
    """What a message declares: tokens, hidden width, dtype."""

    tokens: int
    hidden: int
    dtype: str

    @property
    def embeds_bytes(self) -> int:
        return self.tokens * self.hidden * ITEM_BYTES[self.dtype]


def _bad(reason: str) -> InvalidRequest:
    return InvalidRequest(FIELD, reason)


def declared(message: inference_service_pb2.PromptEmbeds) -> EmbedsShape:
    """The declared shape and dtype, checked for sense."""
    if message.dtype not in ITEM_BYTES:
        allowed = ", ".join(sorted(ITEM_BYTES))
        raise _bad(f"dtype {message.dtype!r} is not one of {allowed}")
    shape = list(message.shape)
    if len(shape) != 2 or min(shape) < 1:
        raise _bad(f"shape {shape} is not [tokens, hidden] with both at least 1")
    return EmbedsShape(shape[0], shape[1], message.dtype)


def check_header(
    message: inference_service_pb2.PromptEmbeds, limit: int = MAX_EMBEDS_BYTES
) -> EmbedsShape:
    """The declared shape, once the file's length and header agree with it (reads no tensor)."""
    shape = declared(message)
    data = message.safetensors
    if len(data) > limit:
        raise _bad(f"{len(data)} bytes is above this stage's limit of {limit}")
    if len(data) < 8:
        raise _bad("the safetensors file is shorter than its header length")
    (header_len,) = struct.unpack("<Q", data[:8])
    if header_len > min(MAX_HEADER_BYTES, len(data) - 8):
        raise _bad(f"the safetensors header length {header_len} does not fit the file")
    try:
        header = json.loads(data[8 : 8 + header_len])
    except (ValueError, UnicodeDecodeError):
        raise _bad("the safetensors header is not JSON") from None
    if not isinstance(header, dict):
        raise _bad("the safetensors header is not an object")
    header.pop("__metadata__", None)
    if set(header) != {FIELD, MASK}:
        raise _bad(f"the file holds {sorted(header)}, not [{FIELD!r}, {MASK!r}]")
    expected = {
        FIELD: (shape.dtype, [shape.tokens, shape.hidden], shape.embeds_bytes),
        MASK: ("I64", [shape.tokens], shape.tokens * 8),
    }
    total = 0
    for name, (dtype, dims, size) in expected.items():
        entry = header[name]
        if not isinstance(entry, dict):
            raise _bad(f"the header's {name!r} is not an object")
        if entry.get("dtype") != dtype or entry.get("shape") != dims:
            raise _bad(
                f"{name} is {entry.get('dtype')} {entry.get('shape')}, declared {dtype} {dims}"
            )
        offsets = entry.get("data_offsets")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) for o in offsets)
            or offsets[1] - offsets[0] != size
        ):
            raise _bad(f"{name}'s data offsets {offsets} do not hold {size} bytes")
        total += size
    if len(data) - 8 - header_len != total:
        raise _bad(f"the file holds {len(data) - 8 - header_len} data bytes, declared {total}")
    return shape


def pack(embeds: torch.Tensor, mask: torch.Tensor) -> inference_service_pb2.PromptEmbeds:
    """The message for ``embeds`` [tokens, hidden] and ``mask`` [tokens] (any integer dtype)."""
    import torch
    from safetensors.torch import save

    names = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
    if embeds.dim() != 2 or embeds.dtype not in names:
        raise ValueError(
            f"prompt embeds must be 2-D float, got {embeds.dtype} {list(embeds.shape)}"
        )
    tensors = {
        FIELD: embeds.detach().to("cpu").contiguous(),
        MASK: mask.detach().to("cpu", torch.int64).contiguous(),
    }
    return inference_service_pb2.PromptEmbeds(
        safetensors=save(tensors), shape=list(embeds.shape), dtype=names[embeds.dtype]
    )


def unpack(
    message: inference_service_pb2.PromptEmbeds, limit: int = MAX_EMBEDS_BYTES
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(embeds, mask)`` of a checked message (on the CPU)."""
    from safetensors.torch import load

    check_header(message, limit)
    tensors = load(message.safetensors)
    embeds, mask = tensors[FIELD], tensors[MASK]
    if not embeds.isfinite().all():
        raise _bad("holds values that are not finite")
    if ((mask != 0) & (mask != 1)).any():
        raise _bad("the mask holds values other than 0 and 1")
    if not bool(mask.any()):
        raise _bad("the mask covers no token")
    return embeds, mask


def stack(
    pairs: list[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch [n, tokens, hidden] and its mask [n, tokens] from same-shape pairs."""
    import torch

    shapes = {tuple(e.shape) for e, _ in pairs}
    if len(shapes) != 1:
        raise ValueError(f"prompt embeds of one batch have one shape, got {sorted(shapes)}")
    return torch.stack([e for e, _ in pairs]), torch.stack([m for _, m in pairs])


def nbytes(shape: EmbedsShape) -> int:
    """The file's data bytes for ``shape`` (embeds and mask)."""
    return shape.embeds_bytes + shape.tokens * 8


def same(a: inference_service_pb2.PromptEmbeds, b: inference_service_pb2.PromptEmbeds) -> bool:
    """Whether two messages carry the same tensors bit for bit."""
    return a.safetensors == b.safetensors and list(a.shape) == list(b.shape) and a.dtype == b.dtype


__all__ = [
    "FIELD",
    "ITEM_BYTES",
    "MASK",
    "MAX_EMBEDS_BYTES",
    "MAX_MESSAGE_BYTES",
    "EmbedsShape",
    "check_header",
    "declared",
    "nbytes",
    "pack",
    "same",
    "stack",
    "unpack",
]
