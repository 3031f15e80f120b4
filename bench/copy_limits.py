"""Copy limits of a 2-GPU host, measured as ``bench/multi_gpu.py`` measures them (in a child).

Page-locked host<->device copies of one buffer per device, H2D and D2H, each device alone and
both devices at once (one thread per device, as the worker's engine copies), with the engine's
own exact-size host buffers (registered portable). Needs torch and the worker's engine only (no
gRPC), so ``bench/multi_gpu_probe.py`` measures the same limit in a child process of its own:

    python bench/copy_limits.py GIB      # prints one JSON line
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "worker_image/src"))

Json = dict[str, Any]
GiB = 1024**3
DEVICES = 2


def child_limits(gib: float) -> Json:
    """H2D and D2H GB/s per device, alone and with both devices copying at once, with the
    engine's own page-locked host buffers (registered portable, as the engine does)."""
    import torch

    from omnistage_worker.engine.host_memory import HostBuffer

    size = int(gib * GiB)
    buffers = [HostBuffer(size, pin=True) for _ in range(DEVICES)]
    hosts = [b.tensor for b in buffers]
    gpus = [torch.empty(size, dtype=torch.uint8, device=f"cuda:{i}") for i in range(DEVICES)]
    for h in hosts:
        h.fill_(7)

    def copy(i: int, direction: str) -> float:
        with torch.cuda.device(i):
            torch.cuda.synchronize(i)
            start = time.perf_counter()
            if direction == "h2d":
                gpus[i].copy_(hosts[i], non_blocking=True)
            else:
                hosts[i].copy_(gpus[i], non_blocking=True)
            torch.cuda.synchronize(i)
            return time.perf_counter() - start

    def together(direction: str) -> tuple[list[float], float]:
        times = [0.0] * DEVICES
        barrier = threading.Barrier(DEVICES)

        def run(i: int) -> None:
            barrier.wait()
            times[i] = copy(i, direction)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(DEVICES)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return times, time.perf_counter() - start

    out: Json = {"buffer_bytes_per_device": size}
    for direction in ("h2d", "d2h"):
        for i in range(DEVICES):
            best = min(copy(i, direction) for _ in range(4))
            out[f"{direction}_alone_gbps_cuda{i}"] = size / best / 1e9
        runs = [together(direction) for _ in range(4)]
        per = [min(r[0][i] for r in runs) for i in range(DEVICES)]
        wall = min(r[1] for r in runs)
        for i in range(DEVICES):
            out[f"{direction}_together_gbps_cuda{i}"] = size / per[i] / 1e9
        out[f"{direction}_together_aggregate_gbps"] = DEVICES * size / wall / 1e9
    return out


if __name__ == "__main__":
    print(json.dumps(child_limits(float(sys.argv[1]))))
