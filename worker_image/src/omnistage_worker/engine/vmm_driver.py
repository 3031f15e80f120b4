"""The driver's virtual memory calls (``cuMemCreate``, ``cuMemMap``, export and import of a
piece's physical memory as a file descriptor) for one device, each checked, through ctypes (no
GIL held); and the errors they raise, worded as PyTorch words an out-of-memory."""

from __future__ import annotations

import ctypes
import threading
from typing import Any


class Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class AllocationProp(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),  # CU_MEM_ALLOCATION_TYPE_PINNED = 1
        ("requestedHandleTypes", ctypes.c_int),
        ("location", Location),  # CU_MEM_LOCATION_TYPE_DEVICE = 1
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", AllocFlags),
    ]


class AccessDesc(ctypes.Structure):
    _fields_ = [("location", Location), ("flags", ctypes.c_int)]  # PROT_READWRITE = 3


OUT_OF_MEMORY = 2
"""``CUDA_ERROR_OUT_OF_MEMORY``."""

POSIX_FD = 1
"""``CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR``: a piece exported as a file descriptor."""


class CudaError(RuntimeError):
    """A driver call failed; ``code`` is its CUresult (:data:`OUT_OF_MEMORY`: no room)."""

    def __init__(self, call: str, code: int) -> None:
        super().__init__(f"{call} returned CUDA error {code}")
        self.code = code


class OutOfMemoryError(RuntimeError):
    """A buffer found no room on its device; worded as PyTorch words its OOM (what the worker's
    OOM handling reads: ``control/oom.py``)."""


def out_of_memory_message(device: int, nbytes: int, free: int, total: int) -> str:
    """PyTorch's wording of an OOM, with the buffer's size and the device's free memory."""
    gib = 1 << 30
    return (
        f"CUDA out of memory. Tried to allocate {nbytes / gib:.2f} GiB. GPU {device} has a "
        f"total capacity of {total / gib:.2f} GiB of which {free / gib:.2f} GiB is free."
    )


class VmmDriver:
    """The driver's virtual memory calls for one device, each checked (ctypes: no GIL held)."""

    _lock = threading.Lock()
    _lib: Any = None

    def __init__(self, device: int, *, exportable: bool = False) -> None:
        self.lib = self._library()
        self.exportable = exportable
        """Memory it makes can be handed to another process (:meth:`export`)."""
        self.prop = AllocationProp(
            type=1,
            requestedHandleTypes=POSIX_FD if exportable else 0,
            location=Location(type=1, id=device),
        )
        self.access = AccessDesc(location=Location(type=1, id=device), flags=3)
        granularity = ctypes.c_size_t()
        self.check(
            "cuMemGetAllocationGranularity",
            self.lib.cuMemGetAllocationGranularity(
                ctypes.byref(granularity), ctypes.byref(self.prop), 0
            ),
        )
        self.granularity = granularity.value

    @classmethod
    def _library(cls) -> Any:
        with cls._lock:
            if cls._lib is None:
                lib = ctypes.CDLL("libcuda.so.1")
                u64, size = ctypes.c_ulonglong, ctypes.c_size_t
                signatures: dict[str, list[Any]] = {
                    "cuMemGetAllocationGranularity": [
                        ctypes.POINTER(size),
                        ctypes.POINTER(AllocationProp),
                        ctypes.c_int,
                    ],
                    "cuMemAddressReserve": [ctypes.POINTER(u64), size, size, u64, u64],
                    "cuMemAddressFree": [u64, size],
                    "cuMemCreate": [
                        ctypes.POINTER(u64),
                        size,
                        ctypes.POINTER(AllocationProp),
                        u64,
                    ],
                    "cuMemMap": [u64, size, size, u64, u64],
                    "cuMemSetAccess": [u64, size, ctypes.POINTER(AccessDesc), size],
                    "cuMemUnmap": [u64, size],
                    "cuMemRelease": [u64],
                    "cuMemExportToShareableHandle": [ctypes.c_void_p, u64, ctypes.c_int, u64],
                    "cuMemImportFromShareableHandle": [
                        ctypes.POINTER(u64),
                        ctypes.c_void_p,
                        ctypes.c_int,
                    ],
                }
                for name, args in signatures.items():
                    fn = getattr(lib, name)
                    fn.argtypes, fn.restype = args, ctypes.c_int
                cls._lib = lib
            return cls._lib

    @staticmethod
    def check(call: str, code: int) -> None:
        if code != 0:
            raise CudaError(call, code)

    def reserve(self, nbytes: int) -> int:
        ptr = ctypes.c_ulonglong()
        self.check(
            "cuMemAddressReserve", self.lib.cuMemAddressReserve(ctypes.byref(ptr), nbytes, 0, 0, 0)
        )
        return ptr.value

    def free_range(self, ptr: int, nbytes: int) -> None:
        self.check("cuMemAddressFree", self.lib.cuMemAddressFree(ptr, nbytes))

    def create(self, nbytes: int) -> int:
        """New physical memory on the device; its handle."""
        handle = ctypes.c_ulonglong()
        self.check(
            "cuMemCreate",
            self.lib.cuMemCreate(ctypes.byref(handle), nbytes, ctypes.byref(self.prop), 0),
        )
        return handle.value

    def map(self, ptr: int, nbytes: int, handle: int) -> None:
        self.check("cuMemMap", self.lib.cuMemMap(ptr, nbytes, 0, handle, 0))

    def set_access(self, ptr: int, nbytes: int) -> None:
        self.check(
            "cuMemSetAccess", self.lib.cuMemSetAccess(ptr, nbytes, ctypes.byref(self.access), 1)
        )

    def map_new(self, ptr: int, nbytes: int) -> int:
        """Physical memory created, mapped at ``ptr`` and made accessible; its handle."""
        return self._mapped(ptr, nbytes, self.create(nbytes))

    def map_imported(self, ptr: int, nbytes: int, fd: int) -> int:
        """The physical memory of ``fd`` (another process's export) mapped at ``ptr`` and made
        accessible; its handle here (``fd`` stays the caller's to close)."""
        return self._mapped(ptr, nbytes, self.import_fd(fd))

    def _mapped(self, ptr: int, nbytes: int, handle: int) -> int:
        """``handle`` mapped at ``ptr`` and made accessible; released if either fails."""
        try:
            self.map(ptr, nbytes, handle)
        except CudaError:
            self.lib.cuMemRelease(handle)
            raise
        try:
            self.set_access(ptr, nbytes)
        except CudaError:
            self.unmap_release(ptr, nbytes, handle)
            raise
        return handle

    def unmap_release(self, ptr: int, nbytes: int, handle: int) -> None:
        self.check("cuMemUnmap", self.lib.cuMemUnmap(ptr, nbytes))
        self.check("cuMemRelease", self.lib.cuMemRelease(handle))

    def export(self, handle: int) -> int:
        """A file descriptor of ``handle``'s physical memory (the memory lives while it does)."""
        fd = ctypes.c_int()
        self.check(
            "cuMemExportToShareableHandle",
            self.lib.cuMemExportToShareableHandle(ctypes.byref(fd), handle, POSIX_FD, 0),
        )
        return fd.value

    def import_fd(self, fd: int) -> int:
        """A handle here of the physical memory of ``fd`` (another process's export)."""
        handle = ctypes.c_ulonglong()
        self.check(
            "cuMemImportFromShareableHandle",
            self.lib.cuMemImportFromShareableHandle(
                ctypes.byref(handle), ctypes.c_void_p(fd), POSIX_FD
            ),
        )
        return handle.value
