"""Probe: how fast the CUDA driver maps fresh physical memory, by piece size and threads.

A vLLM stage's level-1 wake on an H200 spends 0.63 s mapping its 109.5 GiB KV cache
(``cuMemCreate`` + ``cuMemMap`` + ``cuMemSetAccess`` per allocation, through vLLM's C extension),
while the weights' 9.2 GB copy ends inside that (bench/results/vllm_stage.md). This measures the
same driver calls, made here through ctypes (which releases the GIL), over ``--gib`` GiB:

- ``serial``: one thread, pieces of ``--pieces`` sizes, with the create, map and access calls
  timed apart;
- ``threads-N``: the same pieces shared among N threads (each sets the process's context
  current), to see whether the driver maps in parallel.

Every piece is unmapped and released between runs. It prints and writes one JSON.

    PYTHONPATH=$PWD/worker_image/src:$PWD python3 -m bench.cumem_map_probe --gib 96 \
        --out $OUT/cumem_map_probe.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.reporting import emit
from omnistage_worker.engine.vmm_driver import VmmDriver

GIB = 1 << 30


class Driver(VmmDriver):
    """The engine's driver calls, plus the context each of the probe's threads makes current."""

    def __init__(self, device: int) -> None:
        super().__init__(device)
        get, put = self.lib.cuCtxGetCurrent, self.lib.cuCtxSetCurrent
        get.argtypes, get.restype = [ctypes.POINTER(ctypes.c_void_p)], ctypes.c_int
        put.argtypes, put.restype = [ctypes.c_void_p], ctypes.c_int
        context = ctypes.c_void_p()
        self.check("cuCtxGetCurrent", get(ctypes.byref(context)))
        self.context = context

    def make_current(self) -> None:
        self.check("cuCtxSetCurrent", self.lib.cuCtxSetCurrent(self.context))


def timed(fn: Callable[[], Any]) -> float:
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


def run(driver: Driver, base: int, piece: int, count: int, threads: int) -> dict[str, Any]:
    """Map ``count`` pieces of ``piece`` bytes at ``base`` from ``threads`` threads; release."""
    handles: dict[int, int] = {}
    parts = {"create": 0.0, "map": 0.0, "access": 0.0}

    def one(i: int) -> None:
        ptr = base + i * piece
        t0 = time.perf_counter()
        handle = driver.create(piece)
        t1 = time.perf_counter()
        driver.map(ptr, piece, handle)
        t2 = time.perf_counter()
        driver.set_access(ptr, piece)
        t3 = time.perf_counter()
        handles[i] = handle
        if threads == 1:
            parts["create"] += t1 - t0
            parts["map"] += t2 - t1
            parts["access"] += t3 - t2

    def every(fn: Callable[[int], None]) -> None:
        for i in range(count):
            fn(i)

    if threads == 1:
        seconds = timed(lambda: every(one))
    else:
        with ThreadPoolExecutor(threads, initializer=driver.make_current) as pool:
            list(pool.map(lambda _: None, range(threads)))  # threads started, contexts set
            seconds = timed(lambda: list(pool.map(one, range(count))))
    release = timed(
        lambda: every(lambda i: driver.unmap_release(base + i * piece, piece, handles[i]))
    )
    total = piece * count
    result: dict[str, Any] = {
        "piece_gib": piece / GIB, "pieces": count, "threads": threads,
        "seconds": round(seconds, 4), "gbps": round(total / seconds / 1e9, 1),
        "release_seconds": round(release, 4),
    }  # fmt: skip
    if threads == 1:
        result["parts_seconds"] = {k: round(v, 4) for k, v in parts.items()}
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=96.0)
    parser.add_argument("--pieces", default="0.5,3,12", help="piece sizes in GiB")
    parser.add_argument("--threads", default="1,2,4,8")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--out")
    args = parser.parse_args()
    import torch

    torch.cuda.set_device(args.device)
    torch.cuda.synchronize()  # the primary context is current in this thread
    driver = Driver(args.device)
    total = int(args.gib * GIB) // driver.granularity * driver.granularity
    base = driver.reserve(total)
    report: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python3", *sys.argv]),
        "gpu": torch.cuda.get_device_name(args.device),
        "granularity_bytes": driver.granularity,
        "runs": [],
    }
    try:
        for gib in (float(x) for x in args.pieces.split(",")):
            piece = int(gib * GIB) // driver.granularity * driver.granularity
            count = total // piece
            for threads in (int(x) for x in args.threads.split(",")):
                runs = [run(driver, base, piece, count, threads) for _ in range(args.repeats)]
                best = min(runs, key=lambda r: r["seconds"])
                best["seconds_all"] = [r["seconds"] for r in runs]
                report["runs"].append(best)
                print(json.dumps(best), flush=True)
    finally:
        driver.free_range(base, total)
    serial = [r for r in report["runs"] if r["threads"] == 1]
    report["summary"] = {
        "serial_gbps_median": statistics.median(r["gbps"] for r in serial) if serial else None,
        "best": max(report["runs"], key=lambda r: r["gbps"]) if report["runs"] else None,
    }
    emit(report, Path(args.out) if args.out else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
