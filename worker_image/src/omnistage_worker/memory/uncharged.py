"""Device memory the process holds that NVML charges to no process: pieces mapped from a
hand-over whose descriptors it keeps (``engine/handoff.py``, ``engine/vmm.py``)."""

from __future__ import annotations

import threading


class _Kept:
    """Bytes this process has mapped from hand-overs whose descriptors it keeps, per device.

    NVML charges memory to no process while a descriptor of it is open
    (``bench/results/handoff_charge_probe_h200.json``: B imported four pieces and kept their
    descriptors, and NVML charged B, like A, with none of them); the worker keeps them to hand
    the pieces on at its next sleep (the driver exports no imported memory again), so its
    measured use adds these (:mod:`.nvml`)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_device: dict[int, int] = {}

    def add(self, device: int, nbytes: int) -> None:
        with self.lock:
            self.by_device[device] = self.by_device.get(device, 0) + nbytes


KEPT = _Kept()


def kept_bytes(device: int) -> int:
    """Bytes mapped on ``device`` (torch's index) from kept hand-off descriptors."""
    with KEPT.lock:
        return KEPT.by_device.get(device, 0)
