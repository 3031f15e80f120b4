"""The fast vLLM sleep/wake over plain-Python device operations (issue 23): the bytes come back,
the host buffer is allocated once and kept, level 2 and partial wakes keep vLLM's semantics,
a failed wake releases what it mapped, and the CuMemAllocator patch routes through it.

The simulated device applies an asynchronous copy only when the copies are waited for, so a
missing or misplaced wait shows up as wrong bytes or a copy to unmapped memory."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from typing import Any

import pytest

from omnistage_worker.runners import vllm_wake_cuda
from omnistage_worker.runners.vllm_wake import FastCuMem
from omnistage_worker.runners.vllm_wake_plan import WAKE_ORDERS

MiB = 1 << 20


@dataclass
class Data:
    """vLLM's ``AllocationData``: ``handle`` = (device, size, ptr, memory handle)."""

    handle: tuple[int, int, int, int]
    tag: str
    cpu_backup_tensor: Any = None


class Buffer:
    def __init__(self, dev: FakeDevice, nbytes: int) -> None:
        self.dev, self.nbytes = dev, nbytes
        self.base = 0x7000_0000_0000 + 0x1000_0000 * len(dev.buffers)
        self.data = bytearray(nbytes)
        self.released = False
        dev.buffers.append(self)

    def ptr(self) -> int:
        return self.base

    def release(self) -> None:
        self.released = True


class FakeDevice:
    """Mapped allocations (ptr -> bytes), host buffers, copies pending until the wait."""

    def __init__(self, records: dict[int, Data], fail_map: int | None = None) -> None:
        self.records = records
        self.mem: dict[int, bytearray] = {ptr: bytearray(d.handle[1]) for ptr, d in records.items()}
        self.buffers: list[Buffer] = []
        self.pending: list[tuple[int, int, int]] = []
        self.log: list[tuple[str, int]] = []
        self.fail_map = fail_map

    # WakeOps
    def create_and_map(self, handle: Any) -> None:
        ptr = handle[2]
        if ptr == self.fail_map:
            raise RuntimeError("CUDA_ERROR_OUT_OF_MEMORY")
        assert ptr not in self.mem, "mapped twice"
        self.mem[ptr] = bytearray(b"\xee" * handle[1])  # fresh memory holds garbage
        self.log.append(("map", ptr))

    def unmap_and_release(self, handle: Any) -> None:
        ptr = handle[2]
        assert not any(ptr in (d, s) for d, s, _ in self.pending), "released under a copy"
        del self.mem[ptr]
        self.log.append(("release", ptr))

    def copy_async(self, dst: int, src: int, nbytes: int) -> None:
        self.pending.append((dst, src, nbytes))
        self.log.append(("copy", dst))

    def sync_copies(self) -> None:
        for dst, src, n in self.pending:
            self._write(dst, self._read(src, n))
        self.pending = []
        self.log.append(("sync", 0))

    def sync_device(self) -> None:
        self.log.append(("sync_device", 0))

    def host_buffer(self, nbytes: int) -> Buffer:
        return Buffer(self, nbytes)

    def collect_garbage(self) -> None:
        self.log.append(("gc", 0))

    def empty_cache(self) -> None:
        self.log.append(("empty_cache", 0))

    # the simulated address space
    def _where(self, addr: int) -> tuple[bytearray, int]:
        if addr in self.mem:
            return self.mem[addr], 0
        for b in self.buffers:
            if not b.released and b.base <= addr < b.base + b.nbytes:
                return b.data, addr - b.base
        raise AssertionError(f"copy touches unmapped address {addr:#x}")

    def _read(self, addr: int, n: int) -> bytes:
        buf, off = self._where(addr)
        return bytes(buf[off : off + n])

    def _write(self, addr: int, data: bytes) -> None:
        buf, off = self._where(addr)
        buf[off : off + len(data)] = data


def allocator() -> dict[int, Data]:
    sizes = [("weights", 4 * MiB), ("weights", 2 * MiB), ("kv_cache", 8 * MiB), ("weights", 100)]
    return {
        ptr: Data((0, size, ptr, 0), tag)
        for ptr, (tag, size) in zip((0x1000, 0x2000, 0x3000, 0x4000), sizes, strict=True)
    }


def fill(dev: FakeDevice, seed: int) -> dict[int, bytes]:
    for ptr, buf in dev.mem.items():
        pattern = bytes((seed + ptr + i) % 251 for i in range(251))
        buf[:] = (pattern * (len(buf) // 251 + 1))[: len(buf)]
    return {ptr: bytes(buf) for ptr, buf in dev.mem.items()}


@pytest.mark.parametrize("order", WAKE_ORDERS)
def test_level1_cycles_restore_the_weights_with_one_buffer_kept(order: str) -> None:
    records = allocator()
    dev = FakeDevice(records)
    fast = FastCuMem(dev, order=order)
    for cycle in range(3):
        before = fill(dev, cycle)
        fast.sleep(records, ("weights",))
        assert dev.mem == {}  # everything released: nothing stays on the device
        assert fast.host_bytes == len(dev.buffers[0].data)
        fast.wake_up(records, None)
        for ptr, data in records.items():
            if data.tag == "weights":
                assert bytes(dev.mem[ptr]) == before[ptr]
            else:
                assert ptr in dev.mem  # the KV cache is mapped again (contents discarded)
    assert len(dev.buffers) == 1 and not dev.buffers[0].released  # pinned once, kept
    assert fast.host_bytes == 6 * MiB + 100
    fast.close()
    assert all(b.released for b in dev.buffers) and fast.host_bytes == 0


def test_one_wait_per_transition_with_the_kv_cache_handled_while_the_copies_run() -> None:
    records = allocator()
    dev = FakeDevice(records)
    fast = FastCuMem(dev)
    fast.sleep(records, ("weights",))
    sleep_log, dev.log = dev.log, []
    assert [op for op, _ in sleep_log].count("sync") == 1
    sync = sleep_log.index(("sync", 0))
    assert sleep_log.index(("release", 0x3000)) < sync  # KV released while copies run
    assert all(sleep_log.index(("release", p)) > sync for p in (0x1000, 0x2000, 0x4000))
    assert sleep_log[0] == ("sync_device", 0) and sleep_log[-2:] == [("gc", 0), ("empty_cache", 0)]

    phases = fast.wake_up(records, None)
    assert [op for op, _ in dev.log].count("sync") == 1 and dev.log[-1] == ("sync", 0)
    assert dev.log.index(("copy", 0x1000)) < dev.log.index(("map", 0x3000))
    assert set(phases.seconds) == {"map_weights", "copies_issued", "map_kv", "sync"}
    assert phases.copy_bytes == 6 * MiB + 100 and phases.copies == 3 and phases.maps == 4
    report = fast.report()
    assert report["wake"]["copy_bytes"] == 6 * MiB + 100 and report["backups"] == 0


def test_level2_discards_the_weights_and_gives_the_buffer_back() -> None:
    records = allocator()
    dev = FakeDevice(records)
    fast = FastCuMem(dev)
    fast.sleep(records, ("weights",))
    fast.wake_up(records, None)
    fast.sleep(records, ())  # vLLM's level 2
    assert dev.buffers[0].released and fast.host_bytes == 0 and dev.mem == {}
    assert "copy" not in [op for op, _ in dev.log[-5:]]
    # level 2's partial wakes: weights mapped (garbage until reloaded), then the KV cache
    fast.wake_up(records, ["weights"])
    assert set(dev.mem) == {0x1000, 0x2000, 0x4000} and dev.mem[0x1000][:1] == b"\xee"
    fast.wake_up(records, ["kv_cache"])
    assert set(dev.mem) == set(records)
    # the next level-1 sleep pins a buffer again
    before = fill(dev, 7)
    fast.sleep(records, ("weights",))
    fast.wake_up(records, None)
    assert len(dev.buffers) == 2 and bytes(dev.mem[0x2000]) == before[0x2000]


def test_a_failed_wake_releases_what_it_mapped_and_keeps_the_backups() -> None:
    records = allocator()
    dev = FakeDevice(records)
    fast = FastCuMem(dev)
    before = fill(dev, 3)
    fast.sleep(records, ("weights",))
    dev.fail_map = 0x3000  # the KV cache does not fit
    with pytest.raises(RuntimeError, match="OUT_OF_MEMORY"):
        fast.wake_up(records, None)
    assert dev.mem == {} and dev.pending == []  # copies waited for, then released
    dev.fail_map = None
    fast.wake_up(records, None)  # a later wake still has the backups
    assert bytes(dev.mem[0x1000]) == before[0x1000] and bytes(dev.mem[0x4000]) == before[0x4000]


def test_a_larger_sleep_replaces_the_buffer() -> None:
    records = allocator()
    dev = FakeDevice(records)
    fast = FastCuMem(dev)
    fast.sleep(records, ("weights",))
    fast.wake_up(records, None)
    records[0x5000] = Data((0, 4 * MiB, 0x5000, 0), "weights")
    dev.mem[0x5000] = bytearray(4 * MiB)
    fast.sleep(records, ("weights",))
    assert dev.buffers[0].released and not dev.buffers[1].released
    assert fast.host_bytes == 10 * MiB + 4096


class FakeAllocator:
    """vLLM's ``CuMemAllocator`` as far as the patch reads it."""

    def __init__(self) -> None:
        self.pointer_to_data = allocator()
        self.vllm_calls: list[str] = []

    def sleep(self, offload_tags: Any = None) -> None:
        self.vllm_calls.append("sleep")

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.vllm_calls.append("wake_up")


def fake_cumem(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    cumem = types.ModuleType("vllm.device_allocator.cumem")
    cumem.cumem_available = True  # type: ignore[attr-defined]
    cumem.CuMemAllocator = type("CuMemAllocator", (FakeAllocator,), {})  # type: ignore[attr-defined]
    package = types.ModuleType("vllm.device_allocator")
    package.cumem = cumem  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.device_allocator", package)
    monkeypatch.setitem(sys.modules, "vllm.device_allocator.cumem", cumem)
    monkeypatch.setattr(vllm_wake_cuda.INSTALLED, "patch", None)
    return cumem


def test_the_patch_routes_cumem_sleep_and_wake_through_the_fast_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cumem = fake_cumem(monkeypatch)
    devices: list[FakeDevice] = []

    def ops(_: Any) -> FakeDevice:
        devices.append(FakeDevice(alloc.pointer_to_data))
        return devices[-1]

    monkeypatch.setattr(vllm_wake_cuda, "CudaOps", ops)
    assert vllm_wake_cuda.install() is None
    alloc = cumem.CuMemAllocator()
    alloc.sleep(offload_tags=("weights",))  # as vLLM's Worker.sleep(level=1) calls it
    alloc.wake_up(None)
    assert alloc.vllm_calls == [] and len(devices) == 1
    assert ("copy", 0x1000) in devices[0].log
    report = vllm_wake_cuda.WakeExtension().omnistage_wake_report()
    assert report["installed"] and report["host_buffer_bytes"] == 6 * MiB + 100
    assert report["sleep"]["copy_bytes"] == 6 * MiB + 100


def test_without_the_cuda_operations_vllms_own_methods_run(monkeypatch: pytest.MonkeyPatch) -> None:
    cumem = fake_cumem(monkeypatch)  # no libcudart: CudaOps cannot be built

    assert vllm_wake_cuda.install() is None
    alloc = cumem.CuMemAllocator()
    alloc.sleep(offload_tags=("weights",))
    alloc.wake_up(["weights"])
    assert alloc.vllm_calls == ["sleep", "wake_up"]


def test_without_a_host_buffer_the_sleep_is_vllms_own(monkeypatch: pytest.MonkeyPatch) -> None:
    cumem = fake_cumem(monkeypatch)
    alloc = cumem.CuMemAllocator()
    dev = FakeDevice(alloc.pointer_to_data)

    def no_buffer(nbytes: int) -> Buffer:
        raise RuntimeError("page-locking failed: CUDA error 2")

    monkeypatch.setattr(dev, "host_buffer", no_buffer)
    monkeypatch.setattr(vllm_wake_cuda, "CudaOps", lambda _: dev)
    assert vllm_wake_cuda.install() is None
    alloc.sleep(offload_tags=("weights",))
    assert dev.log == [] and len(dev.mem) == 4  # the fast path touched nothing
    alloc.wake_up(None)
    assert alloc.vllm_calls == ["sleep", "wake_up"]


def test_no_vllm_allocator_no_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_wake_cuda.INSTALLED, "patch", None)
    monkeypatch.setitem(sys.modules, "vllm.device_allocator", None)
    assert "cannot be imported" in (vllm_wake_cuda.install() or "")
    assert vllm_wake_cuda.WakeExtension().omnistage_wake_report()["installed"] is False


FAKE_CUDART = r"""
#include <stddef.h>
#include <string.h>
static int fail = 0;
void fake_fail(int err) { fail = err; }
int cudaStreamCreateWithFlags(void **stream, unsigned int flags) {
    if (flags != 1) return 1;
    *stream = (void *)0x7f0000005151;
    return 0;
}
int cudaMemcpyAsync(void *dst, const void *src, size_t n, int kind, void *stream) {
    if (kind != 4 || stream != (void *)0x7f0000005151) return 1;
    memcpy(dst, src, n);
    return fail;
}
int cudaStreamSynchronize(void *stream) { return stream == (void *)0x7f0000005151 ? fail : 400; }
const char *cudaGetErrorString(int err) { return err == 700 ? "an illegal memory access" : "?"; }
"""


def test_cuda_operations_pass_64_bit_pointers_sizes_and_the_stream(tmp_path: Any) -> None:
    """CudaOps's ctypes prototypes against a stand-in libcudart of the same C signatures: the
    pointers (above 4 GiB), the size, cudaMemcpyDefault and the stream reach the library intact,
    and a CUDA error is raised with its text."""
    import ctypes
    import shutil
    import subprocess
    from types import SimpleNamespace

    if shutil.which("cc") is None:
        pytest.skip("no C compiler")
    (tmp_path / "cudart.c").write_text(FAKE_CUDART)
    lib_path = tmp_path / "libfakecudart.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib_path), str(tmp_path / "cudart.c")],
                   check=True)  # fmt: skip
    lib = ctypes.CDLL(str(lib_path))
    mapped: list[Any] = []
    cumem = SimpleNamespace(
        create_and_map=mapped.append, unmap_and_release=mapped.remove,
        libcudart=SimpleNamespace(lib=lib),
    )  # fmt: skip
    ops = vllm_wake_cuda.CudaOps(cumem)
    src = ctypes.create_string_buffer(b"weights!" * 1000)
    dst = ctypes.create_string_buffer(8000)
    assert ctypes.addressof(src) > 2**32  # a pointer that an int argument would truncate
    ops.copy_async(ctypes.addressof(dst), ctypes.addressof(src), 8000)
    ops.sync_copies()
    assert dst.raw == src.raw[:8000]
    handle = (0, 2 * MiB, 0x7F00_0000_0000, 0x55)
    ops.create_and_map(handle)
    ops.unmap_and_release(handle)
    assert mapped == []
    lib.fake_fail(700)
    with pytest.raises(RuntimeError, match="cudaStreamSynchronize: CUDA error 700"):
        ops.sync_copies()
