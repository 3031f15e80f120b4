"""The host RAM an asleep start takes, measured in a fresh process (run as a module; prints
one JSON line): a long test process's heap (freed blocks kept by the allocator, its raised
mmap threshold) must not decide what the engine's own peak reads."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from omnistage_worker.engine import WeightEngine


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field}")


def measure() -> dict[str, int]:
    """Eight 16 MiB linear layers (128 MiB) started asleep at level 1, then woken."""
    layers = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048, bias=False) for _ in range(8)])
    model_bytes = sum(p.numel() * p.element_size() for p in layers.parameters())
    engine = WeightEngine({"m": layers}, torch.device("cpu"), pin_in_background=False)
    before = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets the peak (VmHWM) to the RSS now
    engine.start_asleep(1)
    grew = _status("VmHWM") - before
    host = engine.host_bytes()
    engine.wake()
    whole = all(p.numel() == 2048 * 2048 for p in layers.parameters())
    engine.close()
    return {"grew": grew, "model_bytes": model_bytes, "host_bytes": host, "woke_whole": whole}


if __name__ == "__main__":
    print(json.dumps(measure()))
