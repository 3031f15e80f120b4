"""Probe: a sleep then a wake in one process, with the sleeping buffer freed at the end of its
copy (as torch's allocator and the engine did) or piece by piece behind it.

The driver cleans freed device memory in the background and host -> device copies run at half
rate while it does (bench/scrub_probe.py). Per mode, ``--repeats`` times, alternating:

- ``torch``: the buffer is a torch allocation, copied to the host, freed (``empty_cache``), and
  the next buffer allocated and filled from the host;
- ``end``: the same with an :class:`omnistage_worker.engine.vmm.PieceBuffer`, released whole
  after the copy;
- ``behind``: a ``PieceBuffer`` whose every piece is released as soon as the copy of it is
  done (an event per piece), while the copy of the next pieces runs.

Reported: the sleep's and wake's seconds, the wake's copy rate, the longest release call, and
the sum against the serial bound (bytes / D2H + bytes / H2D, each measured alone here).

    python3 -m bench.release_behind_probe --gib 16 --out $OUT/release_behind_probe.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from bench.reporting import emit
from bench.scrub_probe import h2d_seconds
from omnistage_worker.engine.vmm import PieceBuffer

GIB = 1 << 30


def timed_copy(dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream) -> float:
    return h2d_seconds(torch, dst, src, stream)


def new_buffer(mode: str, nbytes: int) -> tuple[torch.Tensor, PieceBuffer | None]:
    """A device buffer of ``nbytes``: torch's (``torch``) or a :class:`PieceBuffer`."""
    if mode == "torch":
        return torch.empty(nbytes, dtype=torch.uint8, device="cuda"), None
    pieces = PieceBuffer(nbytes, torch.device("cuda"))
    return pieces.tensor(), pieces


def one(
    mode: str, nbytes: int, hosts: tuple[torch.Tensor, torch.Tensor], stream: Any
) -> dict[str, Any]:
    """A sleep of one buffer then the wake of another (see the module's docstring)."""
    out_host, in_host = hosts
    device, piece_buffer = new_buffer(mode, nbytes)
    device.fill_(3)
    torch.cuda.synchronize()
    time.sleep(2.0)  # any cleaning before this run is over
    began = time.perf_counter()
    longest_release = 0.0
    if mode == "behind":
        assert piece_buffer is not None
        events = []
        with torch.cuda.stream(stream):
            for offset, size in piece_buffer.spans:
                end = min(offset + size, nbytes)
                out_host[offset:end].copy_(device[offset:end], non_blocking=True)
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(stream)
                events.append(event)
        del device
        for k, event in enumerate(events):
            event.synchronize()
            started = time.perf_counter()
            piece_buffer.release(k)
            longest_release = max(longest_release, time.perf_counter() - started)
        piece_buffer.close()
    else:
        with torch.cuda.stream(stream):
            out_host.copy_(device, non_blocking=True)
        stream.synchronize()
        del device
        if piece_buffer is not None:
            piece_buffer.close()
        else:
            torch.cuda.empty_cache()
    slept = time.perf_counter()
    target, woken_buffer = new_buffer(mode, nbytes)
    allocated = time.perf_counter()
    with torch.cuda.stream(stream):
        target.copy_(in_host, non_blocking=True)
    stream.synchronize()
    woke = time.perf_counter()
    del target
    if woken_buffer is not None:
        woken_buffer.close()
    torch.cuda.empty_cache()
    return {
        "mode": mode,
        "sleep_s": round(slept - began, 4),
        "wake_s": round(woke - slept, 4),
        "wake_alloc_s": round(allocated - slept, 4),
        "wake_h2d_gbps": round(nbytes / (woke - allocated) / 1e9, 1),
        "longest_release_s": round(longest_release, 5),
        "total_s": round(woke - began, 4),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=16.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out")
    args = parser.parse_args()
    nbytes = int(args.gib * GIB)
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    hosts = (
        torch.empty(nbytes, dtype=torch.uint8, pin_memory=True),
        torch.ones(nbytes, dtype=torch.uint8, pin_memory=True),
    )
    scratch = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    timed_copy(scratch, hosts[1], stream)
    d2h = min(timed_copy(hosts[0], scratch, stream) for _ in range(3))
    h2d = min(timed_copy(scratch, hosts[1], stream) for _ in range(3))
    del scratch
    torch.cuda.empty_cache()
    bound = d2h + h2d
    runs = [
        one(mode, nbytes, hosts, stream)
        for _ in range(args.repeats)
        for mode in ("torch", "end", "behind")
    ]
    summary: dict[str, Any] = {
        "serial_bound_s": round(bound, 4),
        "d2h_gbps": round(nbytes / d2h / 1e9, 1),
        "h2d_gbps": round(nbytes / h2d / 1e9, 1),
    }
    for mode in ("torch", "end", "behind"):
        mine = [r for r in runs if r["mode"] == mode]
        total = statistics.median(r["total_s"] for r in mine)
        summary[mode] = {
            "total_over_bound": round(total / bound, 3),
            "wake_h2d_gbps": statistics.median(r["wake_h2d_gbps"] for r in mine),
            "sleep_s": statistics.median(r["sleep_s"] for r in mine),
            "wake_s": statistics.median(r["wake_s"] for r in mine),
        }
    report = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python3 -m bench.release_behind_probe", *sys.argv[1:]]),
        "gpu": torch.cuda.get_device_name(),
        "bytes": nbytes,
        "summary": summary,
        "runs": runs,
    }
    emit(report, Path(args.out) if args.out else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
