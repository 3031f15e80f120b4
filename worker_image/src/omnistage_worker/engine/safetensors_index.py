"""Reads the header of safetensors files: which tensor sits at which byte range.

The format is an 8-byte little-endian header length, a JSON header mapping names to dtype, shape
and ``data_offsets`` relative to the data section, then the data section itself.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

MAX_HEADER_BYTES = 100 * 1024 * 1024

DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


class SafetensorsError(ValueError):
    """A safetensors file is malformed."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor in a safetensors file: absolute byte range in the file."""

    name: str
    path: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        """Size of the tensor's data in bytes."""
        return self.end - self.start


def read_index(path: Path) -> dict[str, TensorEntry]:
    """Parse one file's header into entries with absolute file offsets."""
    with path.open("rb") as f:
        raw_len = f.read(8)
        if len(raw_len) != 8:
            raise SafetensorsError(f"{path}: too short for a safetensors header")
        (header_len,) = struct.unpack("<Q", raw_len)
        if header_len > MAX_HEADER_BYTES:
            raise SafetensorsError(f"{path}: header of {header_len} bytes is implausible")
        header = json.loads(f.read(header_len))
    base = 8 + header_len
    size = path.stat().st_size
    entries: dict[str, TensorEntry] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        begin, end = (int(x) for x in meta["data_offsets"])
        dtype = str(meta["dtype"])
        shape = tuple(int(d) for d in meta["shape"])
        if not 0 <= begin <= end or base + end > size:
            raise SafetensorsError(f"{path}: tensor {name!r} lies outside the file")
        entries[name] = TensorEntry(name, path, dtype, shape, base + begin, base + end)
    return entries


def read_indexes(paths: Iterable[Path]) -> dict[str, TensorEntry]:
    """Merge the indexes of several files (shards); a name found twice is an error."""
    merged: dict[str, TensorEntry] = {}
    for path in sorted(paths):
        for name, entry in read_index(path).items():
            if name in merged:
                raise SafetensorsError(f"tensor {name!r} is in both {merged[name].path} and {path}")
            merged[name] = entry
    return merged
