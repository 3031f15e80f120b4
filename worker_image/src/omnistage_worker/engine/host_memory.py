"""Host buffers for offloaded weights: exact-size, page-locked once, reused across cycles.

torch's pinned allocator rounds every block up to a power of two (a 17 GiB model would pin 32 GiB)
and keeps freed blocks cached. So the engine allocates ordinary host memory of the exact size and
page-locks it with ``cudaHostRegister``; copies from it then run at the pinned-copy rate, and
freeing it unregisters and returns it to the OS.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch

log = logging.getLogger(__name__)


def _cudart() -> Any:
    """torch's binding of the CUDA runtime (untyped upstream)."""
    return torch.cuda.cudart()  # type: ignore[no-untyped-call]


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor."""
    return tensor.numpy().data.cast("B")


class HostBuffer:
    """A flat uint8 host tensor, page-locked when CUDA is in use."""

    def __init__(self, nbytes: int, pin: bool) -> None:
        started = time.perf_counter()
        self.tensor = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        self.nbytes = nbytes
        self.pinned = False
        if pin and nbytes > 0:
            err = int(_cudart().cudaHostRegister(self.tensor.data_ptr(), nbytes, 0))
            if err != 0:
                raise RuntimeError(f"cudaHostRegister({nbytes} bytes) failed: CUDA error {err}")
            self.pinned = True
        self.setup_seconds = time.perf_counter() - started
        log.debug("host buffer: %d bytes in %.3fs, pinned=%s", nbytes, self.setup_seconds, pin)

    def release(self) -> None:
        """Unregister and drop the memory."""
        if self.pinned:
            err = int(_cudart().cudaHostUnregister(self.tensor.data_ptr()))
            if err != 0:
                log.warning("cudaHostUnregister failed with CUDA error %d", err)
            self.pinned = False
        self.tensor = torch.empty(0, dtype=torch.uint8)
        self.nbytes = 0


class HostBufferFuture:
    """Prepares a HostBuffer on a background thread, so pinning cost is off the critical path."""

    def __init__(self, nbytes: int, pin: bool) -> None:
        self._result: HostBuffer | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(nbytes, pin), name="omnistage-host-pin", daemon=True
        )
        self._thread.start()

    def _run(self, nbytes: int, pin: bool) -> None:
        try:
            self._result = HostBuffer(nbytes, pin)
        except BaseException as exc:  # re-raised in the caller's thread by result()
            self._error = exc

    def result(self) -> HostBuffer:
        """Wait for the buffer and return it, or raise what preparing it raised."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result
