"""Weights streamed to the device before the model exists, for the engine to adopt.

A cold start imports transformers and builds the model (seconds of single-threaded Python) before
the engine knows its layout; the weight bytes need only torch and the files. So the AR runner
starts a :class:`Preload` right after the residual baseline is measured: every tensor of the
safetensors files, in file order, each at an aligned offset of one device buffer, read by the
engine's own overlapped loader on background threads while the main work imports and builds.

Those are the offsets the engine's layout gives its file-backed slots (file order first, see
``WeightEngine._ordered_specs``) when every tensor of the files is one slot of the model. The
engine's activation then adopts the buffer (:meth:`Preload.adopt`) after checking every one of
its file runs against it; when any differs it frees the buffer first and loads as before, so
the device never holds the weights twice.

While the stream runs, the interpreter's switch interval is lowered (0.5 ms): the readers need
the GIL for a moment per chunk and would otherwise wait up to 5 ms each time behind the imports.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from omnistage_worker.engine.layout import CopyRun, SlotSpec, plan_layout
from omnistage_worker.engine.reload import FileLoader, FileRun
from omnistage_worker.engine.safetensors_index import read_indexes

log = logging.getLogger(__name__)

RESERVE_BYTES = 4096
"""Room after the files' bytes for the model's tensors that are not in them (a rotary table).
The engine adopts the whole buffer as its flat buffer, so this much at most goes unused."""
SWITCH_INTERVAL_S = 0.0005

_pending: dict[torch.device, Preload] = {}
_lock = threading.Lock()


class Preload:
    """One device buffer being filled with a set of safetensors files, in file order."""

    def __init__(self, paths: Sequence[Path], device: torch.device) -> None:
        entries = sorted(read_indexes(paths).values(), key=lambda e: (str(e.path), e.start))
        layout = plan_layout(SlotSpec(i, e.nbytes) for i, e in enumerate(entries))
        self.offsets = {
            (e.path, e.start): p.offset
            for e, p in zip(entries, layout.placements, strict=True)
            if e.nbytes > 0
        }
        self.device = device
        self.flat: torch.Tensor | None = torch.empty(
            layout.total_bytes + RESERVE_BYTES, dtype=torch.uint8, device=device
        )
        self._runs = [
            FileRun(e.path, CopyRun(e.start, self.offsets[(e.path, e.start)], e.nbytes))
            for e in entries
            if e.nbytes > 0
        ]
        self._loader = FileLoader(device)
        self._error: BaseException | None = None
        self.seconds = 0.0
        self._thread = threading.Thread(target=self._run, name="omnistage-preload", daemon=True)
        self._thread.start()

    @property
    def nbytes(self) -> int:
        """Bytes the files hold (the buffer is a little larger)."""
        return sum(r.run.nbytes for r in self._runs)

    def _run(self) -> None:
        interval = sys.getswitchinterval()
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        started = time.perf_counter()
        try:
            assert self.flat is not None
            self._loader.load(self._runs, self.flat)
        except BaseException as exc:  # reported by adopt(); the engine then loads itself
            self._error = exc
        finally:
            sys.setswitchinterval(interval)
            self.seconds = time.perf_counter() - started
            self._loader.release()

    def adopt(self, runs: Sequence[FileRun], total_bytes: int) -> torch.Tensor | None:
        """The whole buffer (at least ``total_bytes``), once filled, when every one of ``runs``
        (the engine's) sits where this buffer put its bytes; None (after freeing the buffer)
        when they do not agree or the stream failed."""
        self._thread.join()
        flat, reason = self.flat, self._disagreement(runs, total_bytes)
        if flat is None or reason is not None:
            log.info("weights streamed ahead not used (%s): loading them again", reason)
            self.release()
            return None
        log.info(
            "weights streamed ahead: %d bytes in %.2fs (%.1f GB/s), adopted",
            self.nbytes,
            self.seconds,
            self.nbytes / max(self.seconds, 1e-9) / 1e9,
        )
        self.flat = None
        return flat

    def _disagreement(self, runs: Sequence[FileRun], total_bytes: int) -> str | None:
        if self._error is not None:
            return f"the stream failed: {self._error}"
        if self.flat is None:
            return "released"
        if total_bytes > self.flat.numel():
            return f"the engine needs {total_bytes} bytes, the buffer holds {self.flat.numel()}"
        if len(runs) != len(self._runs):
            return f"{len(runs)} file tensors in the model, {len(self._runs)} in the files"
        for fr in runs:
            if self.offsets.get((fr.path, fr.run.src_offset)) != fr.run.dst_offset:
                return f"{fr.path.name} at {fr.run.src_offset} is placed elsewhere"
        return None

    def release(self) -> None:
        """Free the buffer (waits for the stream)."""
        self._thread.join()
        self.flat = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def start(paths: Sequence[Path], device: torch.device) -> Preload:
    """Begin streaming ``paths`` to ``device`` (one preload per device; a new one replaces it)."""
    discard(device)
    preload = Preload(paths, device)
    with _lock:
        _pending[device] = preload
    log.info("streaming %d weight bytes to %s ahead of the model", preload.nbytes, device)
    return preload


def take(device: torch.device) -> Preload | None:
    """The preload started for ``device``, handed over once (None: none)."""
    with _lock:
        return _pending.pop(device, None)


def discard(device: torch.device | None = None) -> None:
    """Free the preload of ``device`` (every device: None) that nobody took."""
    with _lock:
        found = [_pending.pop(d) for d in list(_pending) if device is None or d == device]
    for preload in found:
        preload.release()
