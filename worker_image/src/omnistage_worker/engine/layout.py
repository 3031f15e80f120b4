"""Flat-buffer layout of a model's tensors (pure logic, no torch device work).

Every distinct tensor of a model gets a slot in one flat byte buffer, aligned so that dtype views
are legal and kernels see well-aligned pointers. Sleep and wake then move the whole buffer in a
few large copies instead of one copy per tensor.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

ALIGNMENT = 256
"""Byte alignment of every slot: the CUDA caching allocator's own granularity."""


def align_up(value: int, alignment: int = ALIGNMENT) -> int:
    """Round ``value`` up to a multiple of ``alignment``."""
    return (value + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class SlotSpec:
    """One tensor to place: its key and size in bytes."""

    key: int
    nbytes: int


@dataclass(frozen=True)
class Placement:
    """Where a slot lives in the flat buffer."""

    key: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Layout:
    """Offsets of all slots and the flat buffer's total size."""

    placements: tuple[Placement, ...]
    total_bytes: int

    def by_key(self) -> dict[int, Placement]:
        """Placements indexed by slot key."""
        return {p.key: p for p in self.placements}


def plan_layout(slots: Iterable[SlotSpec], alignment: int = ALIGNMENT) -> Layout:
    """Place slots in the given order, each at an ``alignment``-aligned offset."""
    placements: list[Placement] = []
    offset = 0
    for slot in slots:
        if slot.nbytes < 0:
            raise ValueError(f"slot {slot.key} has negative size {slot.nbytes}")
        offset = align_up(offset, alignment)
        placements.append(Placement(slot.key, offset, slot.nbytes))
        offset += slot.nbytes
    return Layout(tuple(placements), align_up(offset, alignment))


@dataclass(frozen=True)
class CopyRun:
    """A contiguous byte range copied from a source position to a destination position."""

    src_offset: int
    dst_offset: int
    nbytes: int


def split_runs(runs: Iterable[CopyRun], chunk_bytes: int) -> list[list[CopyRun]]:
    """Group source-ordered runs into chunks of at most ``chunk_bytes`` of source bytes.

    A run longer than a chunk is cut into pieces; each chunk is a contiguous source range, so a
    reader can fetch it with one read, and the runs inside it say where each piece goes.
    """
    if chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be positive")
    chunks: list[list[CopyRun]] = []
    current: list[CopyRun] = []
    chunk_start = 0
    for run in sorted(runs, key=lambda r: r.src_offset):
        src, dst, left = run.src_offset, run.dst_offset, run.nbytes
        while left > 0:
            if current and (src - chunk_start + 1 > chunk_bytes or src < chunk_start):
                chunks.append(current)
                current = []
            if not current:
                chunk_start = src
            room = chunk_start + chunk_bytes - src
            take = min(left, room)
            current.append(CopyRun(src, dst, take))
            src, dst, left = src + take, dst + take, left - take
    if current:
        chunks.append(current)
    return chunks
