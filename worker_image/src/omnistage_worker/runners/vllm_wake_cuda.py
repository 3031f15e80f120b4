"""vLLM worker extension: installs the fast sleep and wake (:mod:`.vllm_wake`) in vLLM's worker.

The runner passes ``--worker-extension-cls`` (``vllm_serve.FAST_WAKE_EXTENSION``) to the
engine (on by default; ``--no-vllm-fast-wake`` leaves vLLM's own path). vLLM (0.24,
``WorkerWrapperBase.init_worker``) imports this module in each worker process before the
worker is built, and mixes
:class:`WakeExtension` into its class (adding, never overriding, methods: callable through
``collective_rpc``). Importing the module replaces ``CuMemAllocator.sleep`` and ``wake_up`` in that
process (:func:`install`); ``Worker.sleep`` / ``wake_up`` still call them exactly as before, with
the same tags (level 1 offloads "weights", level 2 nothing; partial wakes by tag), and the
buffers saved around them stay vLLM's.

The device operations (:class:`CudaOps`), built at the first sleep in the thread that runs it:

- maps and releases: vLLM's ``create_and_map`` / ``unmap_and_release`` of
  ``vllm.device_allocator.cumem`` (its C extension ``vllm.cumem_allocator``), as vLLM calls them;
- copies: ``cudaMemcpyAsync`` (``cudaMemcpyDefault``) on one non-blocking stream of its own,
  from the libcudart vLLM's ``CudaRTLibrary`` loaded (the one torch uses), with ctypes
  prototypes of their own (the library object's shared attributes are left alone); one
  ``cudaStreamSynchronize`` per transition;
- the host buffer: :class:`omnistage_worker.engine.host_memory.HostBuffer` (exact size,
  ``cuMemHostRegister``-ed, portable), kept across cycles.

If building them fails, or the host buffer cannot be had (before anything moved), that sleep
and its wake run vLLM's own methods (logged).

``OMNISTAGE_VLLM_WAKE_ORDER`` in the engine's environment picks the wake's order of maps and
copies (``overlap``, the default; ``map_first``; ``kv_after``: see ``vllm_wake_plan.WAKE_ORDERS``).

Every allocation is mapped again at a wake through :mod:`.vllm_pieces` (those larger than a
piece in pieces): the module's ``create_and_map`` / ``unmap_and_release``, which vLLM's own sleep
and wake call too, are replaced by ones that map and release them there, and the allocator's
free callback maps such an allocation back as vLLM did before its C extension frees it.
``OMNISTAGE_VLLM_MAP_ALL=0`` leaves the allocations of at most a piece to vLLM,
``OMNISTAGE_VLLM_MAP_PIECES=0`` in the engine's environment leaves every mapping to vLLM.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
from typing import Any

from omnistage_worker.runners.vllm_pieces import PieceDriver, PieceMaps
from omnistage_worker.runners.vllm_wake import (
    WAKE_ORDER_ENV,
    FastCuMem,
    HostBuffer,
    NoHostBuffer,
    WakeOps,
)

log = logging.getLogger("vllm.omnistage.wake")

MAP_PIECES_ENV = "OMNISTAGE_VLLM_MAP_PIECES"
"""Set to ``0`` in the engine's environment: vLLM maps every allocation as one piece."""
MAP_ALL_ENV = "OMNISTAGE_VLLM_MAP_ALL"
"""Set to ``0`` in the engine's environment: allocations of at most a piece are left to vLLM's C
extension (as before 2026-11-30); by default every allocation is mapped at a wake through
:class:`PieceMaps`, those of at most a piece as one piece. On an H200 the level-1 wake after a
rest took 0.190 s instead of 0.211 s that way (the engine's own figure; the same wake's floor
without vLLM 0.190-0.192 s), the vLLM wake of a hand-over 0.180 s instead of 0.198 s
(``bench/results/vllm_stage.md``, "The weights mapped here too")."""
CUDA_MEMCPY_DEFAULT = 4
CUDA_STREAM_NON_BLOCKING = 0x01


class _PinnedBuffer:
    """:class:`HostBuffer` of the worker's engine as :mod:`.vllm_wake` sees it."""

    def __init__(self, nbytes: int) -> None:
        from omnistage_worker.engine.host_memory import HostBuffer as EngineHostBuffer

        self._buffer = EngineHostBuffer(nbytes, pin=True)
        self.nbytes = nbytes
        log.info("pinned a %d-byte host buffer in %.3fs", nbytes, self._buffer.setup_seconds)

    def ptr(self) -> int:
        return int(self._buffer.tensor.data_ptr())

    def release(self) -> None:
        """Unpinned and unmapped in the background (about 0.04 s per GiB, off the sleep's path)."""
        from omnistage_worker.engine.host_memory import release_in_background

        release_in_background(self._buffer)
        self.nbytes = 0


class _DeviceDriver:
    """:class:`omnistage_worker.engine.vmm_driver.VmmDriver` of one device, each call made with that
    device's context current (as vLLM's extension makes sure of before its own calls)."""

    def __init__(self, device: int) -> None:
        import torch

        from omnistage_worker.engine.vmm_driver import VmmDriver

        self._torch = torch
        self._device = device
        with torch.cuda.device(device):
            self._driver = VmmDriver(device)
        self.granularity = self._driver.granularity

    def map_new(self, ptr: int, nbytes: int) -> int:
        with self._torch.cuda.device(self._device):
            return self._driver.map_new(ptr, nbytes)

    def unmap_release(self, ptr: int, nbytes: int, handle: int) -> None:
        with self._torch.cuda.device(self._device):
            self._driver.unmap_release(ptr, nbytes, handle)


def device_driver(device: int) -> PieceDriver:
    """The driver calls :class:`PieceMaps` makes on ``device``."""
    return _DeviceDriver(device)


def piece_maps() -> PieceMaps | None:
    """The process's piece maps (None: :data:`MAP_PIECES_ENV` is ``0``)."""
    if os.environ.get(MAP_PIECES_ENV, "") == "0":
        return None
    from omnistage_worker.engine.vmm import piece_bytes

    take_above = None if os.environ.get(MAP_ALL_ENV, "") == "0" else 0
    return PieceMaps(device_driver, piece_bytes(), take_above)


def route_through_pieces(cumem: Any, pieces: PieceMaps) -> str | None:
    """Replace ``cumem``'s ``create_and_map`` / ``unmap_and_release`` with ones that map the
    allocations ``pieces`` takes in pieces, and wrap the allocator's free callback so such an
    allocation is one mapping again before vLLM's C extension frees it; None when done, else
    why not (the allocator already handed its free callback to the extension)."""
    cls = cumem.CuMemAllocator
    instance = getattr(cls, "instance", None)
    if instance is not None and getattr(instance, "allocator_and_pools", None):
        return "vLLM's allocator gave its free callback to its extension before the patch"
    vllm_create = getattr(cumem, "create_and_map", None)
    vllm_release = getattr(cumem, "unmap_and_release", None)
    vllm_free = getattr(cls, "_python_free_callback", None)
    if vllm_create is None or vllm_release is None or vllm_free is None:
        return "vLLM's cumem module has no create_and_map, unmap_and_release or free callback"

    def create_and_map(handle: Any) -> None:
        device, size, ptr = int(handle[0]), int(handle[1]), int(handle[2])
        if pieces.takes(size):
            pieces.map(device, ptr, size)
        else:
            vllm_create(handle)

    def unmap_and_release(handle: Any) -> None:
        if pieces.holds(int(handle[2])):
            pieces.release(int(handle[2]))
        else:
            vllm_release(handle)

    def python_free_callback(self: Any, ptr: int) -> Any:
        handle = vllm_free(self, ptr)
        pieces.restore(int(handle[2]), lambda: vllm_create(handle))
        return handle

    cumem.create_and_map, cumem.unmap_and_release = create_and_map, unmap_and_release
    cls._python_free_callback = python_free_callback
    if instance is not None:  # its bound callback, not handed to the extension yet
        instance.python_free_callback = instance._python_free_callback
    return None


class CudaOps:
    """:class:`.vllm_wake.WakeOps` on the GPU, over vLLM's ``cumem`` module."""

    def __init__(self, cumem: Any) -> None:
        import torch

        self._torch = torch
        self._create = cumem.create_and_map
        self._release = cumem.unmap_and_release
        lib = cumem.libcudart.lib  # CudaRTLibrary's CDLL: the libcudart vLLM and torch share
        c = ctypes
        self._memcpy_async = c.CFUNCTYPE(
            c.c_int, c.c_void_p, c.c_void_p, c.c_size_t, c.c_int, c.c_void_p
        )(("cudaMemcpyAsync", lib))
        create = c.CFUNCTYPE(c.c_int, c.POINTER(c.c_void_p), c.c_uint)(
            ("cudaStreamCreateWithFlags", lib)
        )
        self._stream_sync = c.CFUNCTYPE(c.c_int, c.c_void_p)(("cudaStreamSynchronize", lib))
        self._error_string = c.CFUNCTYPE(c.c_char_p, c.c_int)(("cudaGetErrorString", lib))
        self._stream = c.c_void_p()
        self._check(create(c.byref(self._stream), CUDA_STREAM_NON_BLOCKING), "cudaStreamCreate")

    def _check(self, err: int, what: str) -> None:
        if err != 0:
            text = self._error_string(err)
            raise RuntimeError(f"{what}: CUDA error {err} ({text.decode() if text else '?'})")

    def create_and_map(self, handle: Any) -> None:
        self._create(handle)

    def unmap_and_release(self, handle: Any) -> None:
        self._release(handle)

    def copy_async(self, dst: int, src: int, nbytes: int) -> None:
        err = self._memcpy_async(dst, src, nbytes, CUDA_MEMCPY_DEFAULT, self._stream)
        self._check(err, "cudaMemcpyAsync")

    def sync_copies(self) -> None:
        self._check(self._stream_sync(self._stream), "cudaStreamSynchronize")

    def sync_device(self) -> None:
        self._torch.cuda.synchronize()

    def host_buffer(self, nbytes: int) -> HostBuffer:
        return _PinnedBuffer(nbytes)

    def collect_garbage(self) -> None:
        gc.collect()

    def empty_cache(self) -> None:
        self._torch.cuda.empty_cache()


class _Patch:
    """The replaced methods of ``CuMemAllocator`` (one allocator per worker process)."""

    def __init__(self, cumem: Any) -> None:
        self.cumem = cumem
        cls = cumem.CuMemAllocator
        self.vllm_sleep = cls.sleep
        self.vllm_wake_up = cls.wake_up
        self.fast: FastCuMem | None = None
        self.vllm_slept = False  # this cycle went through vLLM's own methods

    def _fast(self) -> FastCuMem | None:
        if self.fast is None:
            try:
                ops: WakeOps = CudaOps(self.cumem)
            except Exception:
                log.exception("fast sleep/wake unavailable; vLLM's own methods run")
                return None
            order = os.environ.get(WAKE_ORDER_ENV) or "overlap"
            self.fast = FastCuMem(ops, order=order)
            log.info("fast sleep/wake ready (wake order: %s)", order)
        return self.fast

    def sleep(self, allocator: Any, offload_tags: tuple[str, ...] | str | None = None) -> None:
        fast = self._fast()
        self.vllm_slept = fast is None
        if fast is not None:
            try:
                fast.sleep(allocator.pointer_to_data, offload_tags)
                return
            except NoHostBuffer:  # nothing was moved yet: vLLM's own sleep (and wake) instead
                log.exception("fast sleep without its host buffer; vLLM's own sleep runs")
                self.vllm_slept = True
        self.vllm_sleep(allocator, offload_tags)

    def wake_up(self, allocator: Any, tags: list[str] | None = None) -> None:
        if self.vllm_slept or self.fast is None:
            self.vllm_wake_up(allocator, tags)
            return
        self.fast.wake_up(allocator.pointer_to_data, tags)


class _Installed:
    """The patch installed in this process (None: not installed)."""

    patch: _Patch | None = None


INSTALLED = _Installed()


def install() -> str | None:
    """Replace ``CuMemAllocator.sleep`` / ``wake_up`` in this process; None when installed (or
    already), else why not."""
    if INSTALLED.patch is not None:
        return None
    try:
        from vllm.device_allocator import cumem
    except Exception as exc:  # ImportError, or its libcudart lookup failing
        return f"vLLM's cumem allocator cannot be imported ({type(exc).__name__}: {exc})"
    if not getattr(cumem, "cumem_available", False):
        return "vLLM's cumem allocator is not available on this platform"
    pieces = piece_maps()
    why_not = route_through_pieces(cumem, pieces) if pieces is not None else MAP_PIECES_ENV + "=0"
    if why_not is not None:
        log.info("vLLM maps every allocation whole: %s", why_not)
    patch = _Patch(cumem)
    cls = cumem.CuMemAllocator

    def sleep(self: Any, offload_tags: tuple[str, ...] | str | None = None) -> None:
        patch.sleep(self, offload_tags)

    def wake_up(self: Any, tags: list[str] | None = None) -> None:
        patch.wake_up(self, tags)

    cls.sleep = sleep
    cls.wake_up = wake_up
    INSTALLED.patch = patch
    log.info("omnistage fast sleep/wake installed on vLLM's CuMemAllocator")
    return None


class WakeExtension:
    """Mixed into vLLM's worker class: ``collective_rpc("omnistage_wake_report")`` answers the
    kept host buffer's size and the last sleep's and wake's phases."""

    def omnistage_wake_report(self) -> dict[str, Any]:
        if INSTALLED.patch is None:
            return {"installed": False, "reason": NOT_INSTALLED}
        fast = INSTALLED.patch.fast
        return {"installed": True, **(fast.report() if fast is not None else {})}


NOT_INSTALLED = install()
if NOT_INSTALLED is not None:
    log.warning("omnistage fast sleep/wake not installed: %s", NOT_INSTALLED)
