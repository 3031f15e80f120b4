"""Page-locking the engine's host copy in chunks, in the background, off the first token's path.

``cuMemHostRegister`` of a 16.6 GiB buffer took 4.3 s on the H200 and held the driver's lock for
all of it: the first forward (1.5 s alone) ran 4.3 s beside it. A :class:`ChunkPinner` registers
the buffer one chunk at a time (each its own registration), in order, and pauses between chunks,
so another thread's driver calls wait at most one chunk. It also steps aside while the worker
runs the model (:data:`REQUESTS`, entered by the warm-up and every request): measured on the
H200 with pauses alone, the first requests after Active ran about 8x slower beside it (the
driver let them run only in the pauses), so a chunk starts only when no request is running,
or after :data:`MAX_WAIT_S` of waiting (pinning still ends under a steady load). The pages of
a chunk are faulted in before its registration, outside the driver's lock, where possible.

A copy between the host buffer and the device is issued as :func:`pieces` at chunk boundaries
(one piece never spans two registrations), all in one call (:func:`copy_pieces`), while
:meth:`ChunkPinner.hold` keeps the pinned prefix still: the pinned prefix is copied at the
page-locked rate, the rest through the pageable path (``wait=True`` finishes the pinning
first, at full speed, instead).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import torch

from omnistage_worker.engine.activity import REQUESTS, Activity
from omnistage_worker.engine.host_memory import PORTABLE, HostBuffer, _driver, cuda_context

log = logging.getLogger(__name__)

CHUNK_BYTES = 64 << 20
"""About 16 ms of page-locking on the H200 (0.26 s/GiB): the longest another thread waits."""

PAUSE_S = 0.002
"""Left to other threads after each chunk (adds about 12% to the pinning's own time)."""

MAX_WAIT_S = 0.5
"""Longest a chunk waits for the requests to stop (a steady load loses 16 ms in each 0.5 s)."""

_MADV_POPULATE_WRITE = 23
"""Linux >= 5.14: fault pages in (contents kept) without holding anyone else's lock."""


class PageLocker(Protocol):
    """Page-locks and unlocks host ranges (the CUDA driver, or ``mlock`` in tests)."""

    def lock(self, ptr: int, nbytes: int) -> None: ...

    def unlock(self, ptr: int, nbytes: int) -> None: ...


class CudaLocker:
    """``cuMemHostRegister`` per range (portable), in the context captured at construction."""

    def __init__(self) -> None:
        self._context: ctypes.c_void_p | None = cuda_context()

    def lock(self, ptr: int, nbytes: int) -> None:
        driver = _driver()
        if driver is None:
            err = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, PORTABLE))  # type: ignore[no-untyped-call]
        else:
            driver.set_current(self._context)
            err = driver.register(ptr, nbytes, PORTABLE)
        if err != 0:
            raise RuntimeError(f"page-locking {nbytes} host bytes failed: CUDA error {err}")

    def unlock(self, ptr: int, nbytes: int) -> None:
        driver = _driver()
        if driver is None:
            err = int(torch.cuda.cudart().cudaHostUnregister(ptr))  # type: ignore[no-untyped-call]
        else:
            err = driver.unregister(ptr)
        if err != 0:
            log.warning("unregistering host memory failed: CUDA error %d", err)


class ChunkPinner:
    """A host buffer (usable at once) page-locked chunk by chunk on a background thread."""

    def __init__(
        self,
        nbytes: int,
        locker: PageLocker,
        *,
        chunk_bytes: int | None = None,
        pause_s: float | None = None,
        activity: Activity | None = None,
    ) -> None:
        chunk_bytes = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
        pause_s = PAUSE_S if pause_s is None else pause_s
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self.buffer = HostBuffer(nbytes, pin=False)
        self.chunk_bytes = chunk_bytes
        self._locker = locker
        self._pause_s = pause_s
        self._activity = REQUESTS if activity is None else activity
        self._lock = threading.Lock()
        self._hurry = threading.Event()
        self._stop = threading.Event()
        self._locked: list[tuple[int, int]] = []
        self.pinned_bytes = 0
        """Length of the page-locked prefix (grows by whole chunks; the last may be short)."""
        self.error: BaseException | None = None
        self.seconds = 0.0
        self._thread = threading.Thread(target=self._run, name="omnistage-host-pin", daemon=True)
        self._thread.start()

    @property
    def done(self) -> bool:
        """Whether the whole buffer is page-locked."""
        return self.pinned_bytes >= self.buffer.nbytes

    def _populate(self, start: int, length: int) -> None:
        mapping = self.buffer._mapping
        if mapping is None:
            return
        with contextlib.suppress(OSError, ValueError):  # an older kernel: the driver faults them
            mapping.madvise(_MADV_POPULATE_WRITE, start, length)

    def _run(self) -> None:
        started = time.perf_counter()
        base = self.buffer.tensor.data_ptr()
        try:
            while not self._stop.is_set() and not self.done:
                start = self.pinned_bytes
                length = min(self.chunk_bytes, self.buffer.nbytes - start)
                if not self._hurry.is_set():
                    self._activity.wait_idle(MAX_WAIT_S)
                self._populate(start, length)
                # Locked outside ``_lock``: a copy meanwhile takes this chunk as pageable (right
                # either way); only the prefix it copies at the locked rate is published under it.
                self._locker.lock(base + start, length)
                with self._lock:
                    self._locked.append((base + start, length))
                    self.pinned_bytes = start + length
                if not self._hurry.is_set() and self._pause_s > 0:
                    time.sleep(self._pause_s)
        except BaseException as exc:  # the copies fall back to the pageable path
            self.error = exc
            log.warning(
                "page-locking the host copy stopped at %d bytes: %s", self.pinned_bytes, exc
            )
        self.seconds = time.perf_counter() - started
        log.info("host copy: %d bytes page-locked in %.3fs", self.pinned_bytes, self.seconds)

    def finish(self) -> None:
        """Page-lock the rest now, without pauses, and return when done (or failed)."""
        self._hurry.set()
        self._thread.join()

    @contextlib.contextmanager
    def hold(self, *, wait: bool = False) -> Iterator[int]:
        """Keep the pinner still (``wait``: finish it first); yields the pinned prefix's length."""
        if wait:
            self.finish()
        with self._lock:
            yield self.pinned_bytes

    def release(self) -> None:
        """Stop pinning, unlock every chunk and free the buffer."""
        self._stop.set()
        self._thread.join()
        for ptr, length in self._locked:
            self._locker.unlock(ptr, length)
        self._locked = []
        self.pinned_bytes = 0
        self.buffer.release()


Piece = tuple[torch.Tensor, torch.Tensor]
"""A destination and a source of the same size: one call of the copy."""


def pieces(dst: torch.Tensor, src: torch.Tensor, host_offset: int, chunk_bytes: int) -> list[Piece]:
    """1-D uint8 ``src`` -> ``dst`` as pieces that do not cross a chunk boundary of the host
    buffer (``host_offset``: where this range starts in it): one piece never spans two
    registrations (a copy that does is staged through the pageable path)."""
    if dst.numel() != src.numel():
        raise ValueError(f"copy of {src.numel()} bytes into {dst.numel()}")
    total = src.numel()
    done = 0
    out: list[Piece] = []
    while done < total:
        edge = (host_offset + done) // chunk_bytes * chunk_bytes + chunk_bytes
        length = min(total - done, edge - (host_offset + done))
        out.append((dst[done : done + length], src[done : done + length]))
        done += length
    return out


class Mark:
    """A point in a queue of copies: :meth:`record` marks, on its device's current stream, that
    the copies issued before it are done; :meth:`wait` waits for that; ``then`` is what may
    happen once they are (a sleep releases the device memory they were copied from). On the
    CPU copies are synchronous, so a mark is done once recorded."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.event = torch.cuda.Event() if device.type == "cuda" else None  # type: ignore[no-untyped-call]
        self.then: Callable[[], None] | None = None

    def record(self) -> None:
        if self.event is not None:
            self.event.record(torch.cuda.current_stream(self.device))

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


def follow_marks(issued: Sequence[Step]) -> None:
    """Each mark's ``then``, once the copies before it are done, in the order they were issued
    (so memory goes back as the copies progress, whichever job it is of)."""
    for step in issued:
        if isinstance(step, Mark) and step.then is not None:
            step.wait()
            step.then()


class Hold:
    """A point in a queue of copies where issuing waits: :func:`copy_pieces` issues the copies
    before it, then calls ``before`` (an overlapped wake maps its next device piece there, once
    its claim is admitted), then goes on."""

    def __init__(self, before: Callable[[], None]) -> None:
        self.before = before


Step = Piece | Mark | Hold
"""What a copy job issues: copies, the marks between them, and where issuing waits."""


def held(
    batch: Sequence[Piece], ends: Sequence[int], map_through: Callable[[int], None]
) -> list[Step]:
    """``batch`` (consecutive pieces of one range, from offset 0, in order) with a :class:`Hold`
    before the first copy that reaches past what is mapped: it maps through the first of
    ``ends`` (ascending device-piece ends) that covers that copy."""
    steps: list[Step] = []
    done = ready = 0
    i = 0
    for piece in batch:
        stop = done + piece[1].numel()
        if stop > ready:
            while i < len(ends) - 1 and ends[i] < stop:
                i += 1
            if ends[i] < stop:
                raise ValueError(f"the device pieces end at {ends[i]}, short of {stop}")
            ready = ends[i]
            steps.append(Hold(functools.partial(map_through, ready)))
        steps.append(piece)
        done = stop
    return steps


def copy_pieces(batch: Sequence[Step]) -> None:
    """Issue every piece's copy (asynchronous where the host side is page-locked) in ONE call:
    ``torch._foreach_copy_`` loops over them in C++ with the GIL released once, so a busy Python
    thread cannot slow the issue down piece by piece. Pieces may be on different devices (each
    copy runs on its device's current stream). A :class:`Mark` splits the call: it is recorded
    once the copies before it are issued."""
    run: list[Piece] = []
    for step in batch:
        if isinstance(step, Mark):
            _copy_run(run)
            run = []
            step.record()
        elif isinstance(step, Hold):
            _copy_run(run)
            run = []
            step.before()
        else:
            run.append(step)
    _copy_run(run)


def _copy_run(run: Sequence[Piece]) -> None:
    if run:
        torch._foreach_copy_([d for d, _ in run], [s for _, s in run], non_blocking=True)


def marked(
    batch: Sequence[Piece], ends: Sequence[int], device: torch.device
) -> tuple[list[Step], list[Mark]]:
    """``batch`` (consecutive pieces of one range, in order) with a :class:`Mark` after the
    piece that completes each of ``ends`` (ascending byte offsets in that range): the marks,
    one per end, tell when the bytes before that end are copied."""
    steps: list[Step] = []
    marks: list[Mark] = []
    done = 0
    for piece in batch:
        steps.append(piece)
        done += piece[1].numel()
        while len(marks) < len(ends) and ends[len(marks)] <= done:
            marks.append(Mark(device))
            steps.append(marks[-1])
    if len(marks) < len(ends):
        raise ValueError(f"the pieces cover {done} bytes, short of {ends[len(marks)]}")
    return steps, marks


def split_copy(dst: torch.Tensor, src: torch.Tensor, host_offset: int, chunk_bytes: int) -> int:
    """:func:`pieces` of ``src`` -> ``dst``, copied (:func:`copy_pieces`); their number."""
    batch = pieces(dst, src, host_offset, chunk_bytes)
    copy_pieces(batch)
    return len(batch)
