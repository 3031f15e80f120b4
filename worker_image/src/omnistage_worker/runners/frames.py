"""Pipeline outputs to PNG bytes: PIL images, or float arrays in [0, 1] (video frames)."""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import numpy as np
from PIL import Image


def to_pil(frame: Any) -> Image.Image:
    """A PIL image from a PIL image or an ``(H, W, C)`` float array in [0, 1] or uint8 array."""
    if isinstance(frame, Image.Image):
        return frame
    array = np.asarray(frame)
    if array.dtype != np.uint8:
        array = (np.clip(array, 0.0, 1.0) * 255.0).round().astype(np.uint8)
    if array.ndim == 3 and array.shape[-1] == 1:
        array = array[..., 0]
    return Image.fromarray(array)


def png(image: Image.Image) -> bytes:
    """PNG-encode one image."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def video_frames(frames: Any, index: int = 0) -> list[Image.Image]:
    """The frames of video ``index`` of a pipeline's ``frames`` output (list or array)."""
    video: Sequence[Any] = frames[index]
    return [to_pil(f) for f in video]
