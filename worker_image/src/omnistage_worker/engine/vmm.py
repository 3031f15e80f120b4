"""A device buffer in separately releasable pieces behind one address range (CUDA's virtual
memory management), so a sleep gives each piece back as soon as its copy to the host is done.

Why, measured on the H200 (``bench/results/scrub_probe.json``): the driver cleans device memory
after it is released, in the background, at about 200 GB/s, and while it cleans, host -> device
copies run at half rate (26 vs 55 GB/s; device -> host copies do not slow). A stage that frees
its whole buffer at the end of its sleep leaves the cleaning to overlap the next stage's wake;
freed piece by piece behind the copy, the cleaning overlaps the sleep's own device -> host copy.

The pieces are ``cuMemCreate`` allocations mapped into one ``cuMemAddressReserve`` range, so the
buffer is one contiguous tensor (:meth:`PieceBuffer.tensor`) whatever its pieces.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from omnistage_worker.engine import handoff
from omnistage_worker.engine.claims import ClaimGate
from omnistage_worker.engine.vmm_driver import (
    OUT_OF_MEMORY,
    CudaError,
    OutOfMemoryError,
    VmmDriver,
    out_of_memory_message,
)
from omnistage_worker.memory import uncharged

log = logging.getLogger(__name__)

PIECE_BYTES = 512 << 20
"""A released piece's cleaning (about 2.5 ms at 200 GB/s) is what may still overlap a wake."""

PIECE_MIB_ENV = "OMNISTAGE_PIECE_MIB"
"""Overrides :data:`PIECE_BYTES` (MiB): an overlapped hand-over's incoming wake trails the
outgoing sleep by about one piece, so smaller pieces shorten its tail."""


def piece_bytes() -> int:
    """:data:`PIECE_BYTES`, or :data:`PIECE_MIB_ENV`'s value when set."""
    mib = os.environ.get(PIECE_MIB_ENV, "")
    return int(mib) << 20 if mib else PIECE_BYTES


RELEASE_BEHIND_ENV = "OMNISTAGE_RELEASE_BEHIND"
"""Set to ``0``: a CUDA engine's flat buffer is one torch allocation, freed whole after a sleep's
copy (the path before this module)."""


class DevicePieces(Protocol):
    """A device buffer in pieces that go back one at a time (:class:`PieceBuffer`)."""

    @property
    def spans(self) -> Sequence[tuple[int, int]]:
        """(offset, size) of each piece, in order."""

    def tensor(self) -> torch.Tensor: ...

    def release(self, k: int) -> None: ...

    def map_through(self, end: int) -> None:
        """Map every piece under the bytes before ``end`` not mapped yet (a buffer made with a
        claim gate maps none at first, and each piece only once its claim is admitted)."""

    def close(self) -> None: ...


PiecesFactory = Callable[[int, torch.device, ClaimGate | None], DevicePieces]
"""Makes a buffer of that many bytes on that device; with a gate (an overlapped wake), a buffer
that maps its pieces later, through :meth:`DevicePieces.map_through`."""


def default_pieces(device: torch.device) -> PiecesFactory | None:
    """:class:`PieceBuffer` for a CUDA device, unless :data:`RELEASE_BEHIND_ENV` is ``0``."""
    if device.type != "cuda" or os.environ.get(RELEASE_BEHIND_ENV, "1") == "0":
        return None
    return make_piece_buffer


def make_piece_buffer(
    nbytes: int, device: torch.device, gate: ClaimGate | None = None
) -> DevicePieces:
    """A :class:`PieceBuffer` of :func:`piece_bytes` pieces."""
    return PieceBuffer(nbytes, device, piece_bytes(), gate=gate)


class Spanned(Protocol):
    """Anything in pieces: their (offset, size) in order."""

    @property
    def spans(self) -> Sequence[tuple[int, int]]: ...


def piece_ends(buffer: Spanned, nbytes: int) -> list[int]:
    """Where each piece's bytes end in a buffer of ``nbytes`` (the last piece's padding cut)."""
    return [min(offset + size, nbytes) for offset, size in buffer.spans]


def piece_spans(nbytes: int, piece_bytes: int, granularity: int) -> list[tuple[int, int]]:
    """(offset, size) of each piece covering ``nbytes``: ``piece_bytes`` rounded up to the
    granularity, the last one shorter (itself rounded up)."""
    if nbytes <= 0:
        return []
    step = -(-max(piece_bytes, granularity) // granularity) * granularity
    spans = []
    for offset in range(0, nbytes, step):
        size = min(step, nbytes - offset)
        spans.append((offset, -(-size // granularity) * granularity))
    return spans


class _Interface:
    """``__cuda_array_interface__`` of a byte range, for :func:`torch.as_tensor`."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }


class PieceBuffer:
    """``nbytes`` of device memory as pieces of one address range (see the module's docstring).

    Every piece is mapped at construction, or with a ``gate`` none, each later by
    :meth:`map_through` once the gate admits its claim; :meth:`release` gives pieces back (in any
    order, each once), :meth:`close` the rest and the address range. The tensor must not be used
    once a piece under it is released, nor under a piece not mapped yet."""

    def __init__(
        self,
        nbytes: int,
        device: torch.device,
        piece_bytes: int = PIECE_BYTES,
        gate: ClaimGate | None = None,
    ) -> None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        self.nbytes = nbytes
        self.driver = VmmDriver(index, exportable=handoff.handoff_dir() is not None)
        self.spans = piece_spans(nbytes, piece_bytes, self.driver.granularity)
        self.reserved = sum(size for _, size in self.spans)
        self.base = self.driver.reserve(self.reserved)
        self.handles: dict[int, int] = {}
        self.handed_fds: dict[int, int] = {}
        """The descriptor of each piece mapped from another process's hand-over."""
        self.gate = gate
        self._mapped_end = 0
        """Every piece starting below this offset has been mapped (some maybe released since)."""
        if gate is not None:
            return
        try:
            with torch.cuda.device(index):
                self._map_all()
        except BaseException:
            self.close()
            raise
        self._mapped_end = self.reserved

    def map_through(self, end: int) -> None:
        """Map the pieces under the bytes before ``end`` in order, each after its claim is
        admitted by the gate (:class:`~omnistage_worker.engine.claims.ClaimTimeout` when it is
        not); out of memory even so, :class:`OutOfMemoryError` (what is mapped stays mapped,
        for :meth:`close`)."""
        with torch.cuda.device(self.device):
            for k, (offset, size) in enumerate(self.spans):
                if offset < self._mapped_end:
                    continue
                if offset >= end:
                    return
                handed = self.gate.claim(size, piece=True) if self.gate is not None else None
                try:
                    self.handles[k] = self._map(k, self.base + offset, size, handed)
                except CudaError as error:
                    if error.code != OUT_OF_MEMORY:
                        raise
                    free, total = torch.cuda.mem_get_info(self.device)
                    message = out_of_memory_message(self.device.index or 0, size, free, total)
                    raise OutOfMemoryError(message) from error
                self._mapped_end = offset + size

    def _map(self, k: int, ptr: int, size: int, handed: int | None) -> int:
        """New memory mapped at ``ptr``, or the piece ``handed`` over, its descriptor kept as
        piece ``k``'s (the driver exports no imported memory again: a later hand-over sends
        this descriptor; a release closes it)."""
        if handed is None:
            return self.driver.map_new(ptr, size)
        try:
            handle = self.driver.map_imported(ptr, size, handed)
        except CudaError as error:  # not a piece of that size after all: it is freed
            os.close(handed)
            log.warning("a piece handed over could not be mapped (%s); new memory instead", error)
            return self.driver.map_new(ptr, size)
        except BaseException:
            os.close(handed)
            raise
        self.handed_fds[k] = handed
        uncharged.KEPT.add(self.device.index or 0, size)
        return handle

    def _map_all(self) -> None:
        """Map every piece; out of memory, give torch's cached blocks back and try once more
        (as torch's own allocator does), then raise :class:`OutOfMemoryError`."""
        for attempt in (1, 2):
            try:
                for k, (offset, size) in enumerate(self.spans):
                    if k not in self.handles:
                        self.handles[k] = self.driver.map_new(self.base + offset, size)
                return
            except CudaError as error:
                if error.code != OUT_OF_MEMORY:
                    raise
                if attempt == 1:
                    torch.cuda.empty_cache()
                    continue
                for k in sorted(self.handles):
                    self.release(k)
                free, total = torch.cuda.mem_get_info(self.device)
                message = out_of_memory_message(self.device.index or 0, self.reserved, free, total)
                raise OutOfMemoryError(message) from error

    def tensor(self) -> torch.Tensor:
        """The whole buffer as one 1-D uint8 tensor on its device."""
        return torch.as_tensor(_Interface(self.base, self.nbytes), device=self.device)

    def release(self, k: int) -> None:
        """Give piece ``k`` back (its copies must be done): handed to the incoming worker of a
        hand-over when its sleep has a sender that takes it (:mod:`.handoff`), else to the
        driver. A piece is sent before this process lets go of it, so its measured use never
        falls by a piece the incoming worker cannot find yet."""
        handle = self.handles.pop(k)
        offset, size = self.spans[k]
        fd = self.handed_fds.pop(k, -1)
        kept = fd >= 0
        sender = handoff.current_sender() if self.driver.exportable else None
        with torch.cuda.device(self.device):  # the driver's calls need the device's context
            try:
                if sender is not None and fd < 0:
                    fd = self._exported(handle)
                if sender is not None and fd >= 0:  # in flight before the use falls
                    sender.send(fd, size)
                self.driver.unmap_release(self.base + offset, size, handle)
            finally:
                if fd >= 0:
                    os.close(fd)  # not sent: the last reference, and the memory is freed
                if kept:
                    uncharged.KEPT.add(self.device.index or 0, -size)

    def _exported(self, handle: int) -> int:
        """A descriptor of ``handle``'s memory, or -1 when the driver gives none (the piece
        is freed instead)."""
        try:
            return self.driver.export(handle)
        except CudaError:
            return -1

    def close(self) -> None:
        """Release every piece still held, then the address range."""
        for k in sorted(self.handles):
            self.release(k)
        if self.base:
            with torch.cuda.device(self.device):
                self.driver.free_range(self.base, self.reserved)
            self.base = 0
