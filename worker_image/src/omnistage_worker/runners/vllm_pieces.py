"""vLLM's large allocations mapped again in pieces at a wake, so mapping them costs what small
ones cost.

vLLM's ``CuMemAllocator`` (0.24, CUDA) backs each allocation with one ``cuMemCreate`` of its whole
size. A level-1 wake maps its KV cache anew, about 26 allocations of 4.2 GiB on the H200 bench
stage, and on that driver creating physical memory costs far more per byte in pieces of
several GiB than in pieces of half a GiB (``bench/results/cumem_map_probe.json``: 96 GiB in
0.2 s as 3 GiB pieces, 0.02-0.07 s as 0.5 GiB ones; vLLM's wake spent 0.43-0.62 s mapping
109.5 GiB, ``vllm_stage_h200_rested.json``). :class:`PieceMaps` maps an allocation larger than
a piece as pieces of :func:`omnistage_worker.engine.vmm.piece_bytes` behind vLLM's own address
range (the tensor over it is unchanged) and gives them back at the next sleep. The smaller ones
(the weights) it maps too, each as one piece, by default (``vllm_wake_cuda.MAP_ALL_ENV``):
mapped here, through ctypes, the wake's copies beside them ran faster than with vLLM's
extension making the same calls (an H200's rested wake 0.190 s against 0.211 s).

vLLM's C extension still frees an allocation itself (``my_free``: unmap the range, release the
one handle it recorded, free the range): whoever frees one held in pieces first gives the
pieces back and maps it again as vLLM did (:meth:`PieceMaps.restore`), so that path finds what
it expects.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from omnistage_worker.engine.vmm import piece_spans

__all__ = ["PieceDriver", "PieceMaps"]


class PieceDriver(Protocol):
    """The driver's calls for one device (:class:`omnistage_worker.engine.vmm_driver.VmmDriver`)."""

    granularity: int

    def map_new(self, ptr: int, nbytes: int) -> int:
        """Physical memory created, mapped at ``ptr`` and made accessible; its handle."""
        ...

    def unmap_release(self, ptr: int, nbytes: int, handle: int) -> None: ...


class PieceMaps:
    """The allocations this process holds in pieces, by device pointer.

    ``driver_for(device)`` gives the driver calls of a device (built once per device, when
    first needed); allocations of at most ``take_above`` bytes (default: ``piece_bytes``) are
    left to vLLM (:meth:`takes`); ``take_above=0`` maps every allocation here, each one of at
    most a piece as one piece."""

    def __init__(
        self,
        driver_for: Callable[[int], PieceDriver],
        piece_bytes: int,
        take_above: int | None = None,
    ) -> None:
        self._driver_for = driver_for
        self._drivers: dict[int, PieceDriver] = {}
        self.piece_bytes = piece_bytes
        self.take_above = piece_bytes if take_above is None else take_above
        self._held: dict[int, tuple[int, list[tuple[int, int, int]]]] = {}
        """ptr -> (device, [(offset, size, handle), ...]) of every allocation held in pieces."""

    def takes(self, size: int) -> bool:
        """Whether an allocation of ``size`` bytes is mapped here, in pieces."""
        return size > self.take_above

    def holds(self, ptr: int) -> bool:
        return ptr in self._held

    def pieces(self, ptr: int) -> list[tuple[int, int]]:
        """(offset, size) of each piece of the allocation at ``ptr`` (empty: not held here)."""
        return [(offset, size) for offset, size, _ in self._held.get(ptr, (0, []))[1]]

    def _driver(self, device: int) -> PieceDriver:
        driver = self._drivers.get(device)
        if driver is None:
            driver = self._drivers[device] = self._driver_for(device)
        return driver

    def map(self, device: int, ptr: int, size: int) -> None:
        """Map ``size`` bytes at ``ptr`` (vLLM's reserved range of that allocation) in pieces;
        if one fails, the pieces mapped before it are given back and the error raised."""
        if ptr in self._held:
            raise ValueError(f"allocation {ptr:#x} is mapped already")
        driver = self._driver(device)
        spans = piece_spans(size, self.piece_bytes, driver.granularity)
        if sum(n for _, n in spans) != size:
            raise ValueError(f"{size} bytes are not a multiple of {driver.granularity}")
        mapped: list[tuple[int, int, int]] = []
        try:
            for offset, n in spans:
                mapped.append((offset, n, driver.map_new(ptr + offset, n)))
        except BaseException:
            for offset, n, handle in reversed(mapped):
                driver.unmap_release(ptr + offset, n, handle)
            raise
        self._held[ptr] = (device, mapped)

    def release(self, ptr: int) -> None:
        """Give back every piece of the allocation at ``ptr`` (held here)."""
        device, mapped = self._held.pop(ptr)
        driver = self._driver(device)
        while mapped:
            offset, n, handle = mapped.pop()
            try:
                driver.unmap_release(ptr + offset, n, handle)
            except BaseException:
                mapped.append((offset, n, handle))
                self._held[ptr] = (device, mapped)  # what is left, for another try
                raise

    def restore(self, ptr: int, map_whole: Callable[[], None]) -> None:
        """The allocation at ``ptr`` back to one mapping made by ``map_whole`` (vLLM's own
        ``create_and_map`` of its handle), if it is held here in pieces."""
        if ptr in self._held:
            self.release(ptr)
            map_whole()
