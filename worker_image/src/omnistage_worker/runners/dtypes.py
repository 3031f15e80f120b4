"""``--dtype auto`` resolved to the dtype the weights are saved in, passed to the loaders.

diffusers (and older transformers) load float32 unless told otherwise, which doubles a bf16
pipeline and makes no tensor match its file for level-2 reloads. The answer comes from the
model's ``config.json`` (``torch_dtype``/``dtype``) or else from the safetensors headers: the
floating dtype holding the most bytes.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from omnistage_worker.engine.safetensors_index import read_index

HEADER_DTYPES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32"}
CONFIG_DTYPES = ("float16", "bfloat16", "float32")


def dtype_from_config(directory: Path) -> str | None:
    """The dtype a transformers ``config.json`` records (None: none recorded)."""
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    for key in ("torch_dtype", "dtype"):
        value = config.get(key)
        if isinstance(value, str) and value.removeprefix("torch.") in CONFIG_DTYPES:
            return value.removeprefix("torch.")
    return None


def dtype_from_headers(paths: Iterable[Path]) -> str | None:
    """The floating dtype with the most bytes in these safetensors files (None: no floats)."""
    totals: Counter[str] = Counter()
    for path in paths:
        for entry in read_index(path).values():
            name = HEADER_DTYPES.get(entry.dtype)
            if name is not None:
                totals[name] += entry.nbytes
    if not totals:
        return None
    return totals.most_common(1)[0][0]


def resolve_dtype(configured: str, config_dirs: Iterable[Path], files: Iterable[Path]) -> str:
    """``configured`` unless it is ``auto``: then a config's dtype, else the headers' (else f32)."""
    if configured != "auto":
        return configured
    for directory in config_dirs:
        found = dtype_from_config(directory)
        if found is not None:
            return found
    return dtype_from_headers(files) or "float32"
