"""vLLM's large allocations mapped in pieces at a wake (issue 23): the pieces cover the
allocation's own address range, an allocation that cannot be mapped whole leaves nothing held,
vLLM's own sleep and wake go through the pieces too, and vLLM's C free path still finds one
mapping and one handle.

The simulated driver keeps a device's physical allocations and mappings as CUDA does: memory
is used from ``cuMemCreate`` until its handle is released and no mapping is left, a mapping is
of one whole allocation at a granularity-aligned address, nothing maps over a mapped byte, an
unmap names exactly one mapping (our code never asks more of it) and creating beyond the
capacity fails with CUDA_ERROR_OUT_OF_MEMORY."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field
from typing import Any

import pytest

from omnistage_worker.engine.vmm_driver import OUT_OF_MEMORY, CudaError
from omnistage_worker.runners import vllm_wake_cuda
from omnistage_worker.runners.vllm_pieces import PieceMaps

MiB = 1 << 20
GRANULARITY = 2 * MiB
INVALID_VALUE = 1


@dataclass
class FakeVa:
    """One device's physical allocations (handle -> size), mappings (ptr -> (size, handle))
    and capacity."""

    capacity: int
    granularity: int = GRANULARITY
    handles: dict[int, int] = field(default_factory=dict)
    released: set[int] = field(default_factory=set)
    maps: dict[int, tuple[int, int]] = field(default_factory=dict)
    calls: list[str] = field(default_factory=list)
    _next: int = 0x100

    @property
    def used(self) -> int:
        mapped = {h for _, h in self.maps.values()}
        return sum(n for h, n in self.handles.items() if h not in self.released or h in mapped)

    def create(self, nbytes: int) -> int:
        self.calls.append("create")
        if nbytes <= 0 or nbytes % self.granularity:
            raise CudaError("cuMemCreate", INVALID_VALUE)
        if self.used + nbytes > self.capacity:
            raise CudaError("cuMemCreate", OUT_OF_MEMORY)
        self._next += 1
        self.handles[self._next] = nbytes
        return self._next

    def map(self, ptr: int, nbytes: int, handle: int) -> None:
        if ptr % self.granularity or self.handles.get(handle) != nbytes or handle in self.released:
            raise CudaError("cuMemMap", INVALID_VALUE)
        if any(p < ptr + nbytes and ptr < p + n for p, (n, _) in self.maps.items()):
            raise CudaError("cuMemMap", INVALID_VALUE)  # over a mapped byte
        self.maps[ptr] = (nbytes, handle)

    def unmap(self, ptr: int, nbytes: int) -> None:
        if self.maps.get(ptr, (None,))[0] != nbytes:
            raise CudaError("cuMemUnmap", INVALID_VALUE)
        del self.maps[ptr]
        self._forget_freed()

    def release(self, handle: int) -> None:
        if handle not in self.handles or handle in self.released:
            raise CudaError("cuMemRelease", INVALID_VALUE)
        self.released.add(handle)
        self._forget_freed()

    def _forget_freed(self) -> None:
        mapped = {h for _, h in self.maps.values()}
        for h in [h for h in self.released if h not in mapped]:
            self.released.discard(h)
            del self.handles[h]

    # PieceDriver, as VmmDriver composes the calls
    def map_new(self, ptr: int, nbytes: int) -> int:
        handle = self.create(nbytes)
        try:
            self.map(ptr, nbytes, handle)
        except CudaError:
            self.release(handle)
            raise
        return handle

    def unmap_release(self, ptr: int, nbytes: int, handle: int) -> None:
        self.unmap(ptr, nbytes)
        self.release(handle)


BASE = 0x7F00_0000_0000


def test_a_large_allocation_is_mapped_in_pieces_over_its_own_range_and_given_back() -> None:
    va = FakeVa(capacity=1 << 30)
    pieces = PieceMaps(lambda device: va, piece_bytes=8 * MiB)
    size = 42 * MiB
    assert pieces.takes(size) and not pieces.takes(8 * MiB)
    pieces.map(0, BASE, size)
    spans = sorted((p - BASE, n) for p, (n, _) in va.maps.items())
    assert spans == [(0, 8 * MiB), (8 * MiB, 8 * MiB), (16 * MiB, 8 * MiB), (24 * MiB, 8 * MiB),
                     (32 * MiB, 8 * MiB), (40 * MiB, 2 * MiB)]  # fmt: skip
    assert pieces.pieces(BASE) == spans and va.used == size
    with pytest.raises(ValueError, match="mapped already"):
        pieces.map(0, BASE, size)
    pieces.release(BASE)
    assert va.maps == {} and va.used == 0 and not pieces.holds(BASE)


def test_an_allocation_that_runs_out_of_memory_leaves_nothing_held() -> None:
    va = FakeVa(capacity=20 * MiB)
    pieces = PieceMaps(lambda device: va, piece_bytes=8 * MiB)
    with pytest.raises(CudaError) as raised:
        pieces.map(0, BASE, 42 * MiB)
    assert raised.value.code == OUT_OF_MEMORY
    assert va.maps == {} and va.used == 0 and not pieces.holds(BASE)
    pieces.map(0, BASE, 16 * MiB)  # what fits still maps
    assert va.used == 16 * MiB


@dataclass
class Data:
    """vLLM's ``AllocationData``: ``handle`` = (device, size, ptr, pointer to the C handle)."""

    handle: tuple[int, int, int, int]
    tag: str


def fake_cumem(monkeypatch: pytest.MonkeyPatch, va: FakeVa) -> types.ModuleType:
    """vLLM 0.24's ``cumem`` module over ``va``: its extension's ``create_and_map`` /
    ``unmap_and_release`` (one allocation of the handle's size; the C handle kept at the
    handle's pointer), and an allocator whose sleep, wake and free call the module's functions
    as vLLM's do (its sleep and wake run where the fast path cannot: no libcudart here)."""
    cumem = types.ModuleType("vllm.device_allocator.cumem")
    c_handles: dict[int, int] = {}

    def create_and_map(handle: Any) -> None:
        _, size, ptr, p_handle = handle
        c_handles[p_handle] = va.create(size)
        va.map(ptr, size, c_handles[p_handle])

    def unmap_and_release(handle: Any) -> None:
        _, size, ptr, p_handle = handle
        va.unmap(ptr, size)
        va.release(c_handles[p_handle])

    class CuMemAllocator:
        instance: Any = None

        def __init__(self) -> None:
            self.pointer_to_data: dict[int, Data] = {}
            self.allocator_and_pools: dict[str, Any] = {}
            self.python_free_callback = self._python_free_callback

        def malloc(self, size: int, tag: str) -> int:
            """The extension's ``my_malloc``: a range, then the callback, then the mapping."""
            ptr = BASE + 0x1_0000_0000 * len(self.pointer_to_data)
            handle = (0, size, ptr, 0x9000 + len(self.pointer_to_data))
            self.pointer_to_data[ptr] = Data(handle, tag)
            create_and_map(handle)  # the extension's C function itself: whole
            return ptr

        def _python_free_callback(self, ptr: int) -> Any:
            return self.pointer_to_data.pop(ptr).handle

        def free(self, ptr: int) -> None:
            """The extension's ``my_free``: the callback, then its own C unmap and release."""
            unmap_and_release(self.python_free_callback(ptr))

        def sleep(self, offload_tags: Any = None) -> None:  # vLLM's own level 2: all released
            for data in self.pointer_to_data.values():
                cumem.unmap_and_release(data.handle)

        def wake_up(self, tags: Any = None) -> None:
            for data in self.pointer_to_data.values():
                cumem.create_and_map(data.handle)

    cumem.create_and_map = create_and_map  # type: ignore[attr-defined]
    cumem.unmap_and_release = unmap_and_release  # type: ignore[attr-defined]
    cumem.CuMemAllocator = CuMemAllocator  # type: ignore[attr-defined]
    cumem.cumem_available = True  # type: ignore[attr-defined]
    package = types.ModuleType("vllm.device_allocator")
    package.cumem = cumem  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.device_allocator", package)
    monkeypatch.setitem(sys.modules, "vllm.device_allocator.cumem", cumem)
    monkeypatch.setattr(vllm_wake_cuda.INSTALLED, "patch", None)
    monkeypatch.setattr(vllm_wake_cuda, "device_driver", lambda device: va)
    monkeypatch.setenv("OMNISTAGE_PIECE_MIB", "8")
    return cumem


def test_vllms_sleep_wake_and_free_go_through_the_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    va = FakeVa(capacity=1 << 30)
    cumem = fake_cumem(monkeypatch, va)
    assert vllm_wake_cuda.install() is None
    alloc = cumem.CuMemAllocator()
    kv = alloc.malloc(42 * MiB, "kv_cache")
    weights = alloc.malloc(6 * MiB, "weights")
    assert len(va.maps) == 2  # vLLM's extension maps at malloc, whole
    alloc.sleep()
    assert va.used == 0
    alloc.wake_up()
    assert sorted(n for p, (n, _) in va.maps.items() if p >= kv and p < kv + 42 * MiB) == [
        2 * MiB, 8 * MiB, 8 * MiB, 8 * MiB, 8 * MiB, 8 * MiB]  # fmt: skip
    assert va.maps[weights][0] == 6 * MiB and va.used == 48 * MiB
    alloc.sleep()
    alloc.wake_up()
    alloc.free(kv)  # the C free path: one unmap of the whole range, one release
    alloc.free(weights)
    assert va.maps == {} and va.used == 0


@pytest.mark.parametrize("map_all", ["", "0"])
def test_every_allocation_is_mapped_here_and_freed_as_vllm_expects(
    monkeypatch: pytest.MonkeyPatch, map_all: str
) -> None:
    va = FakeVa(capacity=1 << 30)
    cumem = fake_cumem(monkeypatch, va)
    monkeypatch.setenv(vllm_wake_cuda.MAP_ALL_ENV, map_all)
    assert vllm_wake_cuda.install() is None
    alloc = cumem.CuMemAllocator()
    kv = alloc.malloc(42 * MiB, "kv_cache")
    weights = alloc.malloc(6 * MiB, "weights")
    alloc.sleep()
    ours: list[tuple[int, int]] = []
    map_new = va.map_new

    def spied(ptr: int, nbytes: int) -> int:
        ours.append((ptr, nbytes))
        return map_new(ptr, nbytes)

    monkeypatch.setattr(va, "map_new", spied)
    alloc.wake_up()
    # the small allocation too goes through the driver calls here, as one piece, unless the
    # switch leaves it to vLLM; the large one in pieces either way
    small_here = map_all != "0"
    assert ((weights, 6 * MiB) in ours) is small_here and len(ours) == 6 + small_here
    assert va.maps[weights][0] == 6 * MiB and va.used == 48 * MiB
    alloc.free(weights)  # mapped back whole for vLLM's C free path: one unmap, one release
    alloc.free(kv)
    assert va.maps == {} and va.used == 0


def test_without_pieces_vllm_maps_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    va = FakeVa(capacity=1 << 30)
    cumem = fake_cumem(monkeypatch, va)
    monkeypatch.setenv(vllm_wake_cuda.MAP_PIECES_ENV, "0")
    assert vllm_wake_cuda.install() is None
    alloc = cumem.CuMemAllocator()
    kv = alloc.malloc(42 * MiB, "kv_cache")
    alloc.sleep()
    alloc.wake_up()
    assert va.maps[kv][0] == 42 * MiB and len(va.maps) == 1


def test_an_allocator_that_handed_out_its_free_callback_is_left_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    va = FakeVa(capacity=1 << 30)
    cumem = fake_cumem(monkeypatch, va)
    alloc = cumem.CuMemAllocator.instance = cumem.CuMemAllocator()
    alloc.allocator_and_pools["weights"] = object()  # the extension holds the old callback
    assert vllm_wake_cuda.install() is None
    kv = alloc.malloc(42 * MiB, "kv_cache")
    alloc.sleep()
    alloc.wake_up()
    assert va.maps[kv][0] == 42 * MiB
    alloc.free(kv)
    assert va.used == 0
