"""The weights a :class:`~omnistage_worker.engine.weights.WeightEngine` moves, and the parts its
transitions are made of.

Every distinct tensor of the model is a slot; the slots are laid out in one flat buffer
(:mod:`.layout`), matched to the safetensors files a level-2 wake reloads them from, bound as
views of the flat buffer or as placeholders, copied to and from one host copy (pinned chunk by
chunk, :mod:`.pinning`), and the tensors outside the flat buffer (created or rebound while awake)
are moved to the host and back around a sleep.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

import torch

from omnistage_worker.engine.attributes import AttributeTensor, attribute_tensors, unmovable
from omnistage_worker.engine.claims import ClaimGate
from omnistage_worker.engine.host_memory import HostBuffer, HostBufferFuture, release_in_background
from omnistage_worker.engine.layout import CopyRun, Layout, SlotSpec, plan_layout
from omnistage_worker.engine.pinning import (
    CHUNK_BYTES,
    ChunkPinner,
    CudaLocker,
    PageLocker,
)
from omnistage_worker.engine.reload import FileLoader, FileRun
from omnistage_worker.engine.safetensors_index import TensorEntry, read_indexes
from omnistage_worker.engine.slots import (
    Slot,
    collect_slots,
    iter_bindings,
    match_entry,
    rebind,
)
from omnistage_worker.engine.vmm import DevicePieces, PiecesFactory, default_pieces

log = logging.getLogger(__name__)

WeightFiles = Mapping[str, Sequence[Path]]
"""Per component name, the safetensors files a level-2 wake reloads that component from."""

SAMPLE_BYTES = 4096

_RELEASE_LOCK = threading.Lock()
"""cuBLAS workspaces are one process-wide table: engines of several devices clear it in turn."""


class EngineError(RuntimeError):
    """A transition was asked for that the engine cannot do."""


class FlatWeights:
    """A model's weights as slots of one flat buffer on one device, with their host copy."""

    def __init__(
        self,
        modules: Mapping[str, torch.nn.Module],
        device: torch.device,
        files: WeightFiles | None = None,
        *,
        pin_in_background: bool = True,
        reload_threads: int | None = None,
        slots: Sequence[Slot] | None = None,
        host_copy: bool = True,
        skip: Collection[tuple[str, str]] = (),
        host_locker: PageLocker | None = None,
        wait_for_pin: bool = False,
        device_pieces: PiecesFactory | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.modules = dict(modules)
        refused = unmovable(self.modules)
        if refused:
            raise EngineError("cannot sleep this model: " + "; ".join(refused))
        self._cuda = self.device.type == "cuda"
        self._skip = tuple(skip)
        """(component, submodule) pairs another engine owns (a nested component)."""
        self._slots: list[Slot] = (
            collect_slots(self.modules, self._skip) if slots is None else list(slots)
        )
        if not self._slots:
            raise EngineError(f"no parameters or buffers to place on {self.device}")
        self._by_key = {s.key: s for s in self._slots}
        # A shard (one device of several) counts only its own tensors: by exact device on
        # CUDA, by object on a CPU that simulates several devices.
        self._members: set[int] | None = None
        if slots is not None:
            self._members = {id(t) for s in self._slots for t in s.tensors}
        self._files_enabled = files is not None
        if files is not None:
            self._attach_files(files)
        self._layout: Layout = plan_layout(self._ordered_specs())
        self._offsets = self._layout.by_key()
        self._flat: torch.Tensor | None = None
        self._make_pieces = device_pieces or default_pieces(self.device)
        self._pieces: DevicePieces | None = None
        """The flat buffer's pieces (:mod:`.vmm`): a level-1 sleep releases them behind its copy."""
        self._host: HostBuffer | None = None
        self._host_future: HostBufferFuture | None = None
        self._pinner: ChunkPinner | None = None
        self._host_locker = host_locker
        self._wait_for_pin = wait_for_pin
        """Sleeping before the pinning is done: finish it (True), else copy the rest pageable."""
        self._host_valid = False
        self._releasing: list[threading.Thread] = []
        self._kept: dict[int, torch.Tensor] = {}
        self._loose: list[tuple[torch.Tensor, torch.device]] = []
        self._attributes: list[tuple[AttributeTensor, torch.device]] = []
        """Plain-attribute device tensors moved to the host by a sleep (and their devices)."""
        self._pin_in_background = pin_in_background and host_copy
        self.host_copy = host_copy
        """False for level-2 stages: no host copy is page-locked while awake."""
        readers = reload_threads or min(8, os.cpu_count() or 1)
        self._loader = FileLoader(self.device, readers=readers)
        self.level = 0
        self._placed = False

    # ---- introspection -------------------------------------------------------------------

    @property
    def weights_bytes(self) -> int:
        """Bytes of all distinct weights and buffers (without alignment padding)."""
        return sum(s.nbytes for s in self._slots)

    @property
    def flat_bytes(self) -> int:
        """Size of the flat device buffer, alignment padding included."""
        return self._layout.total_bytes

    @property
    def file_backed_bytes(self) -> int:
        """Bytes a level-2 wake reloads from files."""
        return sum(s.nbytes for s in self._slots if s.entry is not None)

    @property
    def host_kept_bytes(self) -> int:
        """Bytes kept on the host at level 2 because they are not (verifiably) in the files."""
        return sum(t.numel() * t.element_size() for t in self._kept.values())

    def device_bytes(self) -> int:
        """Exact bytes of the distinct storages the model's tensors hold on the device now."""
        seen: dict[int, int] = {}
        for _, _, tensor in iter_bindings(self.modules, self._skip):
            if not self._mine(tensor) or tensor.numel() == 0:
                continue
            storage = tensor.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return sum(seen.values())

    def host_bytes(self) -> int:
        """Host bytes held for the weights (level-1 buffer and level-2 kept tensors)."""
        held = self._host.nbytes if self._host is not None else 0
        held += self._pinner.buffer.nbytes if self._pinner is not None else 0
        return held + self.host_kept_bytes

    # ---- setup ---------------------------------------------------------------------------

    def _attach_files(self, files: WeightFiles) -> None:
        index: dict[str, dict[str, TensorEntry]] = {
            component: read_indexes(paths) for component, paths in files.items()
        }
        matched = 0
        for slot in self._slots:
            entry = match_entry(slot, index)
            if entry is not None and self._bytes_agree(slot, entry):
                slot.entry = entry
                matched += slot.nbytes
        log.info(
            "weights: %d tensors, %d bytes; %d bytes reloadable from files",
            len(self._slots),
            self.weights_bytes,
            matched,
        )

    @staticmethod
    def _bytes_agree(slot: Slot, entry: TensorEntry) -> bool:
        """Spot-check that the live tensor holds the file's bytes (catches load-time rewrites)."""
        tensor = slot.tensors[0]
        if tensor.numel() == 0 or tensor.device.type == "meta":
            return True
        live = tensor.detach().reshape(-1).view(torch.uint8)
        n = slot.nbytes
        starts = sorted({0, max(0, n // 2 - SAMPLE_BYTES // 2), max(0, n - SAMPLE_BYTES)})
        with entry.path.open("rb") as f:
            for start in starts:
                length = min(SAMPLE_BYTES, n - start)
                f.seek(entry.start + start)
                from_file = f.read(length)
                from_live = live[start : start + length].cpu().numpy().tobytes()
                if from_file != from_live:
                    log.warning("%s differs from its file: kept on host at level 2", slot.names[0])
                    return False
        return True

    def _ordered_specs(self) -> list[SlotSpec]:
        """File-backed slots in file order (sequential reloads), then the rest."""

        def order(slot: Slot) -> tuple[int, str, int, int]:
            if slot.entry is None:
                return (1, "", 0, slot.key)
            return (0, str(slot.entry.path), slot.entry.start, slot.key)

        return [SlotSpec(s.key, s.nbytes) for s in sorted(self._slots, key=order)]

    # ---- helpers -------------------------------------------------------------------------

    def _mine(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is on this engine's device (a shard: this shard's device)."""
        if self._members is None:
            return tensor.device.type == self.device.type
        if self._cuda:
            return tensor.device == self.device
        return id(tensor) in self._members

    def _sync(self) -> None:
        if self._cuda:
            torch.cuda.synchronize(self.device)

    def _view(self, buffer: torch.Tensor, slot: Slot) -> torch.Tensor:
        place = self._offsets[slot.key]
        if slot.nbytes == 0:
            return torch.empty(slot.shape, dtype=slot.dtype, device=buffer.device)
        raw = buffer[place.offset : place.offset + place.nbytes]
        return raw.view(slot.dtype).view(slot.shape)

    def _bind(self, slot: Slot, tensor: torch.Tensor) -> None:
        for t in slot.tensors:
            rebind(t, tensor)

    def _placeholder(self, slot: Slot) -> torch.Tensor:
        return torch.empty(0, dtype=slot.dtype, device=self.device)

    def _bind_views(self, flat: torch.Tensor) -> None:
        for slot in self._slots:
            self._bind(slot, self._view(flat, slot))

    def _bind_placeholders(self) -> None:
        for slot in self._slots:
            self._bind(slot, self._placeholder(slot))

    def _release_device(self) -> None:
        self._bind_placeholders()
        self._flat = None
        self._sync()
        if self._pieces is not None:
            self._pieces.close()
            self._pieces = None
        if self._cuda:
            with _RELEASE_LOCK:  # process-wide state: one device's engine at a time
                torch._C._cuda_clearCublasWorkspaces()
                torch.cuda.empty_cache()

    def _new_flat(self, gate: ClaimGate | None = None, *, lazy: bool = False) -> torch.Tensor:
        """A new device buffer for the flat weights. With a ``gate`` (an overlapped wake): a
        ``lazy`` buffer in pieces maps each under its claim later (``self._pieces``'s
        ``map_through``); any other is claimed whole before it is made."""
        nbytes = self._layout.total_bytes
        lazy = lazy and gate is not None and self._make_pieces is not None
        if gate is not None and not lazy:
            gate.claim(nbytes)
        if self._make_pieces is not None:
            self._pieces = self._make_pieces(nbytes, self.device, gate if lazy else None)
            return self._pieces.tensor()
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def _file_runs(self) -> list[FileRun]:
        return [
            FileRun(s.entry.path, CopyRun(s.entry.start, self._offsets[s.key].offset, s.nbytes))
            for s in self._slots
            if s.entry is not None and s.nbytes > 0
        ]

    def _take_host(self) -> HostBuffer:
        if self._pinner is not None:
            return self._pinner.buffer
        if self._host is None:
            if self._host_future is not None:
                self._host = self._host_future.result()
                self._host_future = None
            else:
                self._host = HostBuffer(self._layout.total_bytes, pin=self._cuda)
        return self._host

    def _start_host_prep(self) -> None:
        if self._host is not None or self._host_future is not None or self._pinner is not None:
            return
        locker = self._host_locker or (CudaLocker() if self._cuda else None)
        if locker is None:
            self._host_future = HostBufferFuture(self._layout.total_bytes, pin=False)
        else:  # page-locked chunk by chunk: the first forward does not wait for the driver
            self._pinner = ChunkPinner(self._layout.total_bytes, locker)

    def _host_held(self) -> contextlib.AbstractContextManager[int]:
        """Keeps the chunked pinning still during a copy with the host copy."""
        if self._pinner is None:
            return contextlib.nullcontext(0)
        return self._pinner.hold(wait=self._wait_for_pin)

    def _chunk(self) -> int:
        return self._pinner.chunk_bytes if self._pinner is not None else CHUNK_BYTES

    def _drop_host(self) -> None:
        """Give the host copy back; unpinning (about 0.04 s per GiB) runs in the background."""
        if self._host_future is not None:
            self._host = self._host_future.result()
            self._host_future = None
        self._releasing = [t for t in self._releasing if t.is_alive()]
        if self._host is not None:
            self._releasing.append(release_in_background(self._host))
            self._host = None
        if self._pinner is not None:
            thread = threading.Thread(target=self._pinner.release, name="omnistage-host-unpin")
            thread.start()
            self._releasing.append(thread)
            self._pinner = None
        self._host_valid = False

    def _offload_loose(self) -> None:
        """Tensors the model created or rebound while awake (not in the flat buffer) go to host."""
        flat_ptrs = {t.data_ptr() for s in self._slots for t in s.tensors}
        for _, _, tensor in iter_bindings(self.modules, self._skip):
            on_device = self._mine(tensor) and tensor.numel() > 0
            if on_device and tensor.data_ptr() not in flat_ptrs:
                self._loose.append((tensor, tensor.device))
                tensor.data = tensor.data.to("cpu")
        if not self._cuda:
            return
        flat = self._flat.untyped_storage().data_ptr() if self._flat is not None else None
        for found in attribute_tensors(
            self.modules, self.device.type, self._skip
        ):  # plain attributes
            if isinstance(found.tensor, torch.nn.Parameter) or (
                found.tensor.untyped_storage().data_ptr() == flat
            ):
                continue  # a reference to a weight: the flat buffer moves it
            device = found.tensor.device
            found.tensor = found.tensor.to("cpu")
            found.put(found.tensor)
            self._attributes.append((found, device))

    def _loose_bytes(self) -> int:
        """The bytes :meth:`_restore_loose` puts back on the device."""
        loose = sum(t.data.nbytes for t, _ in self._loose)
        return loose + sum(f.tensor.nbytes for f, _ in self._attributes)

    def _restore_loose(self) -> None:
        for tensor, device in self._loose:
            tensor.data = tensor.data.to(device)
        self._loose = []
        for found, device in self._attributes:
            found.tensor = found.tensor.to(device)
            found.put(found.tensor)
        self._attributes = []

    def _on_meta(self) -> bool:
        """Whether the model was built on ``meta``: its file-backed weights hold no bytes yet."""
        return any(s.tensors[0].device.type == "meta" for s in self._slots if s.entry is not None)

    def _flat_intact(self) -> bool:
        """Every slot's tensors are still the views of the flat buffer (nothing rebound)."""
        if self._flat is None:
            return False
        base = self._flat.data_ptr()
        for slot in self._slots:
            if slot.nbytes == 0:
                continue
            want = base + self._offsets[slot.key].offset
            if any(t.data_ptr() != want for t in slot.tensors):
                return False
        return True
