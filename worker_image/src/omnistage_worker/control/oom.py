"""A wake that ran out of device memory: how to recognise it and how much more it needed.

Pure logic (no torch import): the wake's allocation per device is taken before it starts
(:func:`wake_allocation`), the device's free memory after the worker went back to sleep, and
the OOM's own words (PyTorch: ``Tried to allocate X GiB ... of which Y MiB is free``) for the
figures at the instant it failed, which may be gone by the time the worker measures.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from omnistage_worker.memory.base import Reading

_UNITS = {"B": 1, "bytes": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
_TRIED = re.compile(r"Tried to allocate ([\d.]+) ?(bytes|B|KiB|MiB|GiB|TiB)")
_FREE = re.compile(r"of which ([\d.]+) ?(bytes|B|KiB|MiB|GiB|TiB) is free")


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it wraps: a multi-device wake names the device first) is a
    device OOM: ``torch.OutOfMemoryError``, CUDA's wording, or the simulated GPU's."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if type(current).__name__ == "OutOfMemoryError" or "out of memory" in str(current).lower():
            return True
        current = current.__cause__ or current.__context__
    return False


def _quantity(match: re.Match[str] | None) -> int | None:
    if match is None:
        return None
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def shortfall_in_message(message: str) -> int:
    """``Tried to allocate`` less ``of which ... is free`` in an OOM message (0: not stated)."""
    tried, free = _quantity(_TRIED.search(message)), _quantity(_FREE.search(message))
    if tried is None or free is None:
        return 0
    return max(0, tried - free)


def wake_allocation(controller: Any) -> list[int]:
    """What a wake of ``controller`` puts on each of its devices (device order): the engine's
    flat buffer less what it holds there already. One figure for a single-device engine."""
    shards = getattr(controller, "shards", None)
    if shards:
        return [max(0, int(s.flat_bytes) - int(s.device_bytes())) for s in shards]
    whole = int(getattr(controller, "flat_bytes", 0) or getattr(controller, "weights_bytes", 0))
    return [max(0, whole - int(controller.device_bytes()))]


def needed_bytes(allocation: Sequence[int], after: Reading, message: str) -> int:
    """How much more a wake that ran out of memory needed than the devices had: per device,
    its allocation less the free memory measured after the worker went back to sleep, summed
    over the devices short. When the room came back before the measurement (the tenant left),
    what the OOM message itself states (rounded as PyTorch prints it), and at least 1: it did
    run out."""
    devices = after.devices
    if len(devices) == len(allocation):
        measured = sum(max(0, need - d.free) for need, d in zip(allocation, devices, strict=True))
    else:
        measured = max(0, sum(allocation) - after.free)
    if measured > 0:
        return measured
    return max(shortfall_in_message(message), 1)
