"""A busy Python thread against a loop of calls that release the GIL, on CPU (issue 23).

A level-1 wake issued its 64 MiB pieces one torch call each; every call releases the GIL and
takes it back, and beside a thread that runs Python without pause each take waited for the
switch interval (5 ms): 1.35 GB/s per device instead of 47.5 on 2 x H200
(``multi_gpu_probe.json``, ``engine_settled_gil_busy``). This measures the same effect on CPU,
with the engine's remedies one at a time. ``--pieces`` pieces, issued one call per piece
(``*_loop``) or all in one call (``*_one_call``), with no other thread (``idle``), beside a busy
thread at the default switch interval (``busy``), and beside it inside
``engine.gil.quick_switching`` (``busy_quick``). Two kinds of call: ``sleep``, a stand-in for
the driver's copy call (``time.sleep`` of ``--call-us``, the GIL released meanwhile; one call:
one sleep of all the pieces' time), and ``copy``, torch copies of ``--piece-kib`` each (one
``copy_`` per piece, or one ``torch._foreach_copy_`` as ``pinning.copy_pieces``), whose CPU
work also competes with the busy thread for the cores.

    python bench/gil_switch_cpu.py --out bench/results/gil_switch_cpu.json   # 10-20 s
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
for extra in ("worker_image/src", "."):
    sys.path.insert(0, str(REPO / extra))

from bench.reporting import emit  # noqa: E402
from omnistage_worker.engine import gil  # noqa: E402

Json = dict[str, Any]


@contextmanager
def busy_thread(on: bool) -> Iterator[None]:
    """While inside (``on``): a thread that runs Python without ever waiting."""
    stop = threading.Event()

    def spin() -> None:
        n = 0
        while not stop.is_set():
            n += 1

    thread = threading.Thread(target=spin, daemon=True)
    if on:
        thread.start()
        time.sleep(0.02)  # running before the timed loop starts
    try:
        yield
    finally:
        stop.set()
        if on:
            thread.join()


def issue(
    mode: str, dsts: list[torch.Tensor], srcs: list[torch.Tensor], call_s: float
) -> Callable[[], None]:
    if mode == "copy_loop":

        def loop() -> None:
            for d, s in zip(dsts, srcs, strict=True):
                d.copy_(s, non_blocking=True)

        return loop
    if mode == "copy_one_call":
        return lambda: torch._foreach_copy_(dsts, srcs, non_blocking=True)
    if mode == "sleep_loop":

        def calls() -> None:
            for _ in dsts:
                time.sleep(call_s)

        return calls
    return lambda: time.sleep(call_s * len(dsts))


def measure(args: argparse.Namespace) -> Json:
    torch.set_num_threads(1)
    size = args.piece_kib * 1024
    src = torch.randint(0, 255, (args.pieces * size,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    srcs = [src[k : k + size] for k in range(0, src.numel(), size)]
    dsts = [dst[k : k + size] for k in range(0, dst.numel(), size)]
    results: Json = {}
    for mode in ("sleep_loop", "sleep_one_call", "copy_loop", "copy_one_call"):
        step = issue(mode, dsts, srcs, args.call_us / 1e6)
        for condition in ("idle", "busy", "busy_quick"):
            times = []
            for _ in range(args.repeats):
                dst.zero_()
                quick = gil.quick_switching() if condition == "busy_quick" else nullcontext()
                with busy_thread(condition != "idle"), quick:
                    started = time.perf_counter()
                    step()
                    times.append(time.perf_counter() - started)
                assert mode.startswith("sleep") or torch.equal(dst, src)
            results[f"{mode}_{condition}"] = {
                "ms_median": 1e3 * statistics.median(times),
                "ms": [1e3 * t for t in times],
            }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pieces", type=int, default=128)
    parser.add_argument("--piece-kib", type=int, default=256)
    parser.add_argument("--call-us", type=float, default=20.0)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    started = datetime.now(UTC).isoformat(timespec="seconds")
    load_before = os.getloadavg()
    results = measure(args)
    report: Json = {
        "date": started,
        "command": " ".join(["python", *sys.argv]),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "default_switch_interval_s": sys.getswitchinterval(),
        "quick_switch_interval_s": gil.SWITCH_INTERVAL_S,
        "pieces": args.pieces,
        "piece_bytes": args.piece_kib * 1024,
        "call_seconds": args.call_us / 1e6,
        "results": results,
        "summary": {name: round(results[name]["ms_median"], 2) for name in results},
    }
    emit(report, args.out)


if __name__ == "__main__":
    main()
