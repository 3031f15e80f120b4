"""A device buffer in pieces on the CPU, behaving as the driver's memory does where the engine
can see it (issue 23's release-behind sleep and overlapped wake).

- a released piece's bytes are gone (overwritten), and a piece is released once;
- a piece mapped later (a buffer made with a claim gate) holds garbage until written: bytes
  copied into it before it was mapped are lost, as a copy into unmapped device memory is;
- with a :class:`SimDevice`, every held piece counts against the device's capacity, and a piece
  that does not fit is refused as ``cuMemCreate`` refuses it (:class:`OutOfMemoryError`).
"""

from __future__ import annotations

import threading

import torch

from omnistage_worker.engine.claims import ClaimGate
from omnistage_worker.engine.vmm import piece_spans
from omnistage_worker.engine.vmm_driver import OutOfMemoryError, out_of_memory_message

PIECE = 4096
GARBAGE = 0xA5


class SimDevice:
    """One device's capacity, shared by the buffers of several engines (several stages)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self.peak = 0
        self.lock = threading.Lock()

    def take(self, nbytes: int) -> None:
        with self.lock:
            if self.used + nbytes > self.capacity:
                free = self.capacity - self.used
                raise OutOfMemoryError(out_of_memory_message(0, nbytes, free, self.capacity))
            self.used += nbytes
            self.peak = max(self.peak, self.used)

    def give(self, nbytes: int) -> None:
        with self.lock:
            self.used -= nbytes


class CpuPieces:
    """A CPU buffer in pieces of :data:`PIECE` bytes (see the module's docstring)."""

    def __init__(
        self,
        nbytes: int,
        device: torch.device,
        log: list[str],
        gate: ClaimGate | None = None,
        sim: SimDevice | None = None,
    ) -> None:
        self.buffer = torch.full((nbytes,), GARBAGE, dtype=torch.uint8, device=device)
        self.spans = piece_spans(nbytes, PIECE, 512)
        self.held: set[int] = set()
        self.log = log
        self.gate = gate
        self.sim = sim
        self.closed = False
        if gate is None:  # mapped whole, or nothing kept (as PieceBuffer gives back)
            try:
                self.map_through(nbytes)
            except OutOfMemoryError:
                self.close()
                raise

    def tensor(self) -> torch.Tensor:
        return self.buffer

    def map_through(self, end: int) -> None:
        for k, (offset, size) in enumerate(self.spans):
            if offset >= end:
                return
            if k in self.held or self.closed:
                continue
            if self.gate is not None:
                self.gate.claim(size)
            if self.sim is not None:
                self.sim.take(size)
            self.buffer[offset : offset + size] = GARBAGE  # fresh memory: nothing of before
            self.held.add(k)
            self.log.append(f"map {k}")

    def release(self, k: int) -> None:
        assert k in self.held, f"piece {k} released twice"
        self.held.remove(k)
        offset, size = self.spans[k]
        self.buffer[offset : offset + size] = GARBAGE  # the memory is the driver's again
        if self.sim is not None:
            self.sim.give(size)
        self.log.append(f"release {k}")

    def close(self) -> None:
        for k in sorted(self.held):
            self.release(k)
        self.closed = True
        self.log.append("close")
