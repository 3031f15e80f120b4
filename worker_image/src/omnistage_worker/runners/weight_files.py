"""Which safetensors files a model folder loads from, chosen the way diffusers/transformers do.

A folder may hold a sharded checkpoint (``*.safetensors.index.json`` and its ``weight_map``),
variant files (``x.fp16.safetensors`` beside ``x.safetensors``, as SDXL ships), or one file. The
loaders take the index first, then the configured variant, then the single non-variant file;
globbing every ``*.safetensors`` would take two copies of each tensor. Pure logic over file names.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

_SHARD = re.compile(r"^(?P<base>.+?)-\d{5}-of-\d{5}$")
INDEX_SUFFIX = ".safetensors.index.json"


class WeightFileError(ValueError):
    """A folder's weight files are ambiguous or inconsistent."""


def _variant_of(filename: str) -> str | None:
    """The variant a ``*.safetensors`` file name carries (``x.fp16.safetensors``: fp16)."""
    stem = filename.removesuffix(".safetensors")
    shard = _SHARD.match(stem)
    if shard is not None:
        stem = shard.group("base")
    return stem.rsplit(".", 1)[1] if "." in stem else None


def _index_variant(filename: str) -> str | None:
    """The variant of an index file (``x.safetensors.index.fp16.json``: fp16; plain: None)."""
    if filename.endswith(INDEX_SUFFIX):
        return None
    match = re.match(r"^.+\.safetensors\.index\.(?P<variant>[^.]+)\.json$", filename)
    return match.group("variant") if match else ""


def choose_from_names(names: Iterable[str], variant: str | None) -> tuple[str, ...]:
    """The file names the loader reads, given every file name of one folder (empty: none).

    Order of preference: the index of ``variant``, the files of ``variant``, the non-variant
    index, the non-variant files. Returns index names as-is (the caller resolves them).
    """
    names = sorted(set(names))
    indexes = {n: _index_variant(n) for n in names if ".safetensors.index." in n}
    weights = [n for n in names if n.endswith(".safetensors")]
    wanted = [variant, None] if variant else [None]
    for want in wanted:
        matching_indexes = [n for n, v in indexes.items() if v == want]
        if len(matching_indexes) > 1:
            raise WeightFileError(f"several weight indexes: {', '.join(matching_indexes)}")
        if matching_indexes:
            return (matching_indexes[0],)
        files = [n for n in weights if _variant_of(n) == want]
        if files:
            if len(files) > 1 and not all(_SHARD.match(n[: -len(".safetensors")]) for n in files):
                raise WeightFileError(f"several weight files without an index: {', '.join(files)}")
            return tuple(files)
    return ()


def weight_files_in(directory: Path, variant: str | None = None) -> list[Path]:
    """The safetensors files the loaders read from ``directory`` (empty: none there)."""
    if not directory.is_dir():
        return []
    chosen = choose_from_names((p.name for p in directory.iterdir()), variant)
    if len(chosen) == 1 and ".safetensors.index." in chosen[0]:
        return _from_index(directory / chosen[0])
    return [directory / name for name in chosen]


def _from_index(index: Path) -> list[Path]:
    """The shard files an index's ``weight_map`` names (each must exist)."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise WeightFileError(f"{index}: not a weight index ({exc})") from exc
    shards = sorted({str(v) for v in weight_map.values()})
    paths = [index.parent / s for s in shards]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise WeightFileError(f"{index} names missing shards: {', '.join(missing)}")
    return paths


def has_variant_files(directory: Path, variant: str) -> bool:
    """Whether ``directory`` holds files of ``variant`` (the loaders fall back without them)."""
    if not directory.is_dir():
        return False
    names: Sequence[str] = [p.name for p in directory.iterdir()]
    return any(_variant_of(n) == variant for n in names if n.endswith(".safetensors")) or any(
        _index_variant(n) == variant for n in names if ".safetensors.index." in n
    )
