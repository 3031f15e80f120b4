"""Recognising a wake that ran out of device memory, and what it needed (pure logic)."""

from __future__ import annotations

from omnistage.worker.v1 import types_pb2
from omnistage_worker.control.oom import is_out_of_memory, needed_bytes, shortfall_in_message
from omnistage_worker.engine.flat_weights import EngineError
from omnistage_worker.memory import DeviceReading, Reading

MiB = 1 << 20
GiB = 1 << 30
TORCH = (
    "CUDA out of memory. Tried to allocate 16.60 GiB. GPU 0 has a total capacity of 79.19 GiB "
    "of which 7.50 GiB is free. Including non-PyTorch memory, this process has 612.00 MiB "
    "memory in use."
)


class OutOfMemoryError(RuntimeError):
    """Named as torch's (torch.OutOfMemoryError), without importing torch."""


def _reading(*free: int) -> Reading:
    devices = tuple(
        DeviceReading(f"cuda:{i}", i, f"GPU-{i}", 0, f, 80 * GiB) for i, f in enumerate(free)
    )
    return Reading(devices, types_pb2.MEMORY_SOURCE_NVML)


def test_out_of_memory_is_recognised_however_it_is_wrapped() -> None:
    assert is_out_of_memory(OutOfMemoryError("whatever it says"))
    assert is_out_of_memory(RuntimeError(TORCH))
    try:
        try:
            raise RuntimeError(TORCH)
        except RuntimeError as inner:  # one device of several: the sharded engine names it
            raise EngineError("device 1 (cuda:1): see cause") from inner
    except EngineError as outer:
        assert is_out_of_memory(outer)
    assert not is_out_of_memory(EngineError("the host copy is not valid"))


def test_shortfall_in_the_message() -> None:
    assert shortfall_in_message(TORCH) == int(16.60 * GiB) - int(7.50 * GiB)
    assert shortfall_in_message("Tried to allocate 2.00 MiB ... of which 512.00 KiB is free") == (
        2 * MiB - 512 * 1024
    )
    assert shortfall_in_message("CUDA error: an illegal memory access") == 0


def test_needed_bytes_per_device() -> None:
    # device 0 fits, device 1 is short by 3 GiB: only the short device counts
    assert needed_bytes([4 * GiB, 10 * GiB], _reading(5 * GiB, 7 * GiB), TORCH) == 3 * GiB
    # one engine over what the reading lists as one device
    assert needed_bytes([16 * GiB], _reading(7 * GiB), "") == 9 * GiB
    # the tenant left before the worker measured: the message's figures at the failure
    assert needed_bytes([16 * GiB], _reading(70 * GiB), TORCH) == shortfall_in_message(TORCH)
    assert needed_bytes([16 * GiB], _reading(70 * GiB), "out of memory") == 1
