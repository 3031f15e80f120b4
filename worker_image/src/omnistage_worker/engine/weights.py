"""WeightEngine: moves a model's weights between the device, pinned host memory and nothing.

Layout: after ``activate`` or any wake, every distinct tensor of the model is a view into ONE flat
device buffer (256-byte aligned slots). So:
- level-1 sleep is one device-to-host copy of that buffer into a host buffer that was page-locked
  once (in the background, right after activation) and is reused on every later cycle; then the
  device buffer is freed and the allocator's cache returned to the driver;
- level-1 wake is one allocation and one host-to-device copy, then the views are rebound;
  a level-1 copy goes in pieces at the host copy's page-locked chunks, issued in one call with
  the switch interval lowered (:mod:`.copy_jobs`), so a busy Python thread does not slow it;
- level-2 sleep drops the weights (and the host buffer); level-2 wake reloads the bytes from the
  model's safetensors files with overlapped multi-threaded reads (see reload.py). Tensors that are
  not in the files (non-persistent buffers, weights converted at load) are kept on the host; their
  size is reported by ``host_kept_bytes``.
Parameters keep their identity: only their ``.data`` is swapped, so tied weights stay tied.

One engine serves one device. A stage on several devices runs one engine per device, each over
the slots placed there (``slots=``); their level-1 copies are issued together from one thread
(:meth:`WeightEngine.wake_job`, :meth:`WeightEngine.sleep_job`; see :mod:`.sharded`).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from omnistage_worker.engine.claims import current_gate, report_release
from omnistage_worker.engine.copy_jobs import CopyJob, JobError, run_jobs
from omnistage_worker.engine.flat_weights import EngineError, FlatWeights
from omnistage_worker.engine.gil import quick_switching
from omnistage_worker.engine.host_memory import HostBuffer
from omnistage_worker.engine.pinning import Step, marked, pieces, split_copy
from omnistage_worker.engine.pinning import held as held_steps
from omnistage_worker.engine.reload import FileLoader
from omnistage_worker.engine.vmm import DevicePieces, piece_ends


@dataclass(frozen=True)
class TransferStats:
    """What one transition moved and how long it took (inside the engine)."""

    bytes_moved: int
    seconds: float
    noop: bool = False


class WeightEngine(FlatWeights):
    """Owns the placement of a model's weights. Not thread-safe: callers serialize transitions."""

    # ---- transitions ---------------------------------------------------------------------

    def activate(self) -> TransferStats:
        """Initial placement: copy the loaded tensors into the flat device buffer."""
        if self._placed:
            raise EngineError("activate() or start_asleep() was already called")
        started = time.perf_counter()
        flat = self._new_flat()
        # The parallel reader beats a pageable copy of the loaded tensors (3x); a model built
        # on ``meta`` has nothing loaded: its bytes come from the files on any device.
        from_files = self._files_enabled and (self._cuda or self._on_meta())
        if from_files:
            self._loader.load(self._file_runs(), flat)
        for slot in self._slots:
            if not (from_files and slot.entry is not None):
                self._view(flat, slot).copy_(slot.tensors[0].data, non_blocking=False)
        self._sync()
        self._flat = flat
        self._bind_views(flat)
        self._placed = True
        self.level = 0
        if self._pin_in_background:
            self._start_host_prep()
        return TransferStats(self.weights_bytes, time.perf_counter() - started)

    def start_asleep(self, level: int) -> TransferStats:
        """Initial placement asleep: level 1 keeps weights in host memory only; 2 keeps nothing."""
        self._check_level(level)
        if self._placed:
            raise EngineError("activate() or start_asleep() was already called")
        started = time.perf_counter()
        moved = 0
        if level == 1:
            # Filled before page-locking, each loaded tensor freed once copied: host RAM stays
            # at about the model's size (pinning first would fault in a second full copy).
            host = HostBuffer(self._layout.total_bytes, pin=False)
            on_meta = self._files_enabled and self._on_meta()
            if on_meta:
                FileLoader(torch.device("cpu")).load(self._file_runs(), host.tensor)
            for slot in self._slots:
                if not (on_meta and slot.entry is not None):
                    self._view(host.tensor, slot).copy_(slot.tensors[0].data)
                self._bind(slot, self._placeholder(slot))
                moved += slot.nbytes
            if self._cuda:
                host.pin()
            self._host = host
            self._host_valid = True
        else:
            moved = self._keep_unbacked(from_host=False, release=True)
        for slot in self._slots:
            self._bind(slot, self._placeholder(slot))
        self._placed = True
        self.level = level
        return TransferStats(moved, time.perf_counter() - started)

    def _keep_unbacked(self, from_host: bool, release: bool = False) -> int:
        """Copy tensors without a file entry to pageable host memory (kept for level-2 wakes);
        ``release``: drop each loaded tensor as soon as it is handled (an asleep start)."""
        moved = 0
        for slot in self._slots:
            if release:
                if slot.entry is None and slot.key not in self._kept:
                    self._kept[slot.key] = slot.tensors[0].data.to("cpu", copy=True)
                    moved += slot.nbytes
                self._bind(slot, self._placeholder(slot))
                continue
            if slot.entry is not None or slot.key in self._kept:
                continue
            if from_host:
                source = self._view(self._take_host().tensor, slot)
            else:
                source = slot.tensors[0].data
            self._kept[slot.key] = source.to("cpu", copy=True)
            moved += slot.nbytes
        return moved

    @staticmethod
    def _check_level(level: int) -> None:
        if level not in (1, 2):
            raise EngineError(f"sleep level must be 1 or 2, got {level}")

    def sleep(self, level: int, *, reuse_host: bool = False) -> TransferStats:
        """Release device memory at ``level`` (1: keep a host copy, 2: drop the weights).

        ``reuse_host``: at level 1, when the host copy is still the one the last wake copied
        from and the weights are the flat buffer's views, skip the copy back (the caller knows
        the weights were only read since: the sequential mode's swaps inside requests)."""
        self._check_level(level)
        if not self._placed:
            raise EngineError("the engine has not placed the weights yet")
        if level == 2 and not self._files_enabled:
            raise EngineError("level 2 needs the model's safetensors files")
        started = time.perf_counter()
        if self.level == level:
            return TransferStats(0, 0.0, noop=True)
        if self.level == 1 and level == 2:
            moved = self._keep_unbacked(from_host=True)
            self._drop_host()
            self.level = 2
            return TransferStats(moved, time.perf_counter() - started)
        if self.level == 2 and level == 1:
            raise EngineError("cannot go from level 2 to level 1 without waking first")
        # awake -> asleep
        if level == 1 and self.can_sleep_by_job(reuse_host):
            return self._run_job(self.sleep_job, started)
        moved = 0
        has_host = self._host is not None or self._pinner is not None
        reused = reuse_host and has_host and self._host_valid
        if level == 1 and reused and self._flat_intact():
            pass  # the host copy already holds these bytes
        elif level == 1:  # some weight was rebound: slot by slot
            host = self._take_host().tensor
            chunk = self._chunk()
            with quick_switching(), self._host_held():
                for slot in self._slots:
                    if slot.nbytes == 0:
                        continue
                    place = self._offsets[slot.key]
                    source = slot.tensors[0].data.contiguous().reshape(-1).view(torch.uint8)
                    split_copy(
                        host[place.offset : place.offset + slot.nbytes],
                        source,
                        place.offset,
                        chunk,
                    )
                moved = self._layout.total_bytes
                self._sync()
            self._host_valid = True
        else:
            moved = self._keep_unbacked(from_host=False)
        self._slept(level)
        return TransferStats(moved, time.perf_counter() - started)

    def _slept(self, level: int) -> None:
        """The rest of a sleep once the copy is done: loose tensors out, device memory freed."""
        self._offload_loose()
        self._release_device()
        if level == 2:
            self._drop_host()  # after the device memory is free: that is what others wait for
        self.level = level

    def can_sleep_by_job(self, reuse_host: bool = False) -> bool:
        """Whether a level-1 sleep now is one copy of the intact flat buffer (a :meth:`sleep_job`):
        awake, nothing rebound, and the host copy not reused."""
        reused = (
            reuse_host and self._host_valid and (self._host is not None or self._pinner is not None)
        )
        return self._placed and self.level == 0 and self._flat_intact() and not reused

    def sleep_job(self) -> CopyJob:
        """A level-1 sleep (:meth:`can_sleep_by_job`) as a copy job; its finish frees the device
        memory."""
        if not self.can_sleep_by_job():
            raise EngineError("a level-1 sleep job needs the awake, intact flat buffer")
        assert self._flat is not None
        host = self._take_host().tensor
        held = contextlib.ExitStack()
        held.enter_context(self._host_held())
        flat = self._flat
        copies = pieces(host, flat, 0, self._chunk())
        behind = self._pieces
        batch: list[Step] = list(copies)
        if behind is not None:  # each piece goes back once its bytes are copied (run_jobs)
            ends = piece_ends(behind, self._layout.total_bytes)
            batch, marks = marked(copies, ends, self.device)
            for k, mark in enumerate(marks):
                mark.then = functools.partial(_release_piece, behind, k)
            self._bind_placeholders()  # the copies hold their own views of the buffer

        def finish() -> int:
            with held:
                self._sync()
            self._host_valid = True
            self._slept(1)
            return self._layout.total_bytes

        def abort() -> None:
            self._abort(held)
            if behind is not None:
                self._bind_views(flat)  # nothing was released: the weights are its views again

        return CopyJob(batch, finish, abort)

    def _abort(self, held: contextlib.ExitStack, release: bool = False) -> None:
        """A job that will not finish: its copies waited for, the host copy let go;
        ``release``: a wake's, whose device buffer was just dropped, goes back to the driver."""
        with held:
            self._sync()
        if release:
            self._release_device()

    @staticmethod
    def _run_job(make: Callable[[], CopyJob], started: float) -> TransferStats:
        """One job of this device alone (:func:`run_jobs`); a failure raised as it was."""
        try:
            (stats,) = run_jobs([make])
        except JobError as error:
            raise error.error  # noqa: B904 - the job's own exception, its traceback kept
        return TransferStats(stats.bytes_moved, stats.ended - started)

    def wake(self) -> TransferStats:
        """Bring the weights back onto the device; the next output is bit-identical to before."""
        if not self._placed:
            raise EngineError("the engine has not placed the weights yet")
        started = time.perf_counter()
        if self.level == 0:
            return TransferStats(0, 0.0, noop=True)
        if self.level == 1:
            return self._run_job(self.wake_job, started)
        flat = self._new_flat(current_gate())
        moved = self._loader.load(self._file_runs(), flat)
        for key, kept in self._kept.items():
            slot = self._by_key[key]
            self._view(flat, slot).copy_(kept, non_blocking=False)
            moved += slot.nbytes
        self._sync()
        self._kept = {}
        self._woken(flat)
        return TransferStats(moved, time.perf_counter() - started)

    def wake_job(self) -> CopyJob:
        """A level-1 wake as a copy job: allocates the device buffer now; its finish rebinds the
        weights."""
        if not self._placed or self.level != 1:
            raise EngineError(f"a level-1 wake job needs level 1, the engine is at {self.level}")
        host = self._take_host()
        if not self._host_valid:
            raise EngineError("the host copy is not valid")
        gate = current_gate()
        flat = self._new_flat(gate, lazy=True)
        held = contextlib.ExitStack()
        held.enter_context(self._host_held())
        copies = pieces(flat, host.tensor, 0, self._chunk())
        batch: list[Step] = list(copies)
        buffer = self._pieces
        if gate is not None and buffer is not None:  # each device piece mapped as it is claimed
            ends = piece_ends(buffer, self._layout.total_bytes)
            batch = held_steps(copies, ends, buffer.map_through)

        def finish() -> int:
            with held:
                self._sync()
            if gate is not None:  # the tensors outside the flat buffer come back too
                gate.claim(self._loose_bytes())
            if not self.host_copy:
                self._drop_host()  # a level-2 stage keeps no host copy while awake
            self._woken(flat)
            return self._layout.total_bytes

        return CopyJob(batch, finish, lambda: self._abort(held, release=True))

    def _woken(self, flat: torch.Tensor) -> None:
        """The rest of a wake once the bytes are in ``flat``: the weights become its views."""
        self._flat = flat
        self._bind_views(flat)
        self._restore_loose()
        self.level = 0
        if self._pin_in_background:
            self._start_host_prep()

    def close(self) -> None:
        """Free every buffer the engine holds."""
        self._drop_host()
        for thread in self._releasing:
            thread.join()
        self._loader.release()


def _release_piece(buffer: DevicePieces, k: int) -> None:
    """Give piece ``k`` back, then say so (an overlapped hand-over's sleep streams it)."""
    buffer.release(k)
    report_release(buffer.spans[k][1])
