"""Probe: what memory that was just freed costs the next allocation, and the copies beside it.

bench/cumem_map_probe.py saw the driver map 96 GiB of never-used memory in 0.02 s and the same
memory, just released by the same process, in 0.16-0.20 s. This asks why and when, with the
driver calls vLLM's allocator makes (``cuMemCreate`` + ``cuMemMap`` + ``cuMemSetAccess``) over
``--gib`` GiB in ``--piece-gib`` pieces:

- ``after_own_free`` with waits: release, wait W seconds, map again; if the cost falls with W,
  the driver cleans freed memory in the background after the release;
- ``after_peer_free``: a second process fills ``--gib`` GiB and frees it (cudaFree, its context
  kept), then this one maps at once: the hand-over's case;
- ``h2d_alone`` / ``h2d_after_free`` / ``h2d_while_mapping``: a ``--copy-gib`` pinned host ->
  device copy on its own, right after a release, and while the mapping runs on another thread;
  if the cleaning uses the copy engines, the copy slows beside it;
- ``copy_timelines``: 256 MiB copies back to back (each way) for 0.8 s after releasing 16 GiB
  and ``--gib`` GiB: how long the cleaning slows them, and so its rate.

It prints and writes one JSON.

    PYTHONPATH=$PWD/worker_image/src:$PWD python3 -m bench.scrub_probe --gib 64 --copy-gib 8 \
        --out $OUT/scrub_probe.json
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.cumem_map_probe import GIB, Driver
from bench.reporting import emit

PEER = r"""
import sys, torch
n = int(sys.argv[1]); torch.cuda.set_device(int(sys.argv[2]))
x = torch.empty(n, dtype=torch.uint8, device="cuda"); x.fill_(7); torch.cuda.synchronize()
print("filled", flush=True); sys.stdin.readline()
del x; torch.cuda.empty_cache(); torch.cuda.synchronize()
print("freed", flush=True); sys.stdin.readline()
"""


class Region:
    """``count`` pieces of ``piece`` bytes at one reserved range, mapped and released whole."""

    def __init__(self, driver: Driver, piece: int, count: int) -> None:
        self.driver, self.piece, self.count = driver, piece, count
        self.base = driver.reserve(piece * count)
        self.handles: list[int] = []

    def map(self) -> float:
        began = time.perf_counter()
        for i in range(self.count):
            ptr = self.base + i * self.piece
            handle = self.driver.create(self.piece)
            self.driver.map(ptr, self.piece, handle)
            self.driver.set_access(ptr, self.piece)
            self.handles.append(handle)
        return time.perf_counter() - began

    def release(self) -> float:
        began = time.perf_counter()
        for i, handle in enumerate(self.handles):
            self.driver.unmap_release(self.base + i * self.piece, self.piece, handle)
        self.handles = []
        return time.perf_counter() - began


def h2d_seconds(torch: Any, dst: Any, src: Any, stream: Any) -> float:
    """One host -> device copy of ``src`` on ``stream``, timed to its end."""
    torch.cuda.synchronize()
    began = time.perf_counter()
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)
    stream.synchronize()
    return time.perf_counter() - began


def copy_timeline(
    torch: Any, release: Callable[[], object], dst: Any, src: Any, *, stream: Any
) -> list[tuple[float, float]]:
    """Call ``release``, then copy ``src`` -> ``dst`` back to back for 0.8 s: (end of each copy
    after the release, its GB/s)."""
    torch.cuda.synchronize()
    began = time.perf_counter()
    release()
    points = []
    while time.perf_counter() - began < 0.8:
        start = time.perf_counter()
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        stream.synchronize()
        end = time.perf_counter()
        points.append((round(end - began, 4), round(src.numel() / (end - start) / 1e9, 1)))
    return points


def map_beside(region: Region, copy: Callable[[], float], copy_bytes: int) -> dict[str, float]:
    """``region`` mapped on another thread while ``copy`` runs here: both's figures."""
    mapped: list[float] = []
    worker = threading.Thread(target=lambda: mapped.append(region.map()))
    began = time.perf_counter()
    worker.start()
    beside = copy()
    worker.join()
    return {
        "h2d_gbps": round(copy_bytes / beside / 1e9, 1), "map_s": round(mapped[0], 4),
        "both_s": round(time.perf_counter() - began, 4),
    }  # fmt: skip


def settled(region: Region) -> Region:
    """``region`` mapped, and left 2 s for any cleaning before it to end."""
    region.map()
    time.sleep(2.0)
    return region


class Peer:
    """A second process holding ``nbytes`` filled on the device, which it frees when asked."""

    def __init__(self, nbytes: int, device: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", PEER, str(nbytes), str(device)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.expect("filled")
        time.sleep(2.0)

    def expect(self, word: str) -> None:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if line != word:
            raise RuntimeError(f"peer said {line!r}, not {word!r}")

    def step(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()

    def free(self) -> None:
        self.step()
        self.expect("freed")

    def end(self) -> None:
        self.step()
        self.proc.wait(timeout=60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=64.0)
    parser.add_argument("--piece-gib", type=float, default=2.0)
    parser.add_argument("--copy-gib", type=float, default=8.0)
    parser.add_argument("--waits", default="0,0.05,0.2,0.5,2")
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--out")
    args = parser.parse_args()
    import torch

    torch.cuda.set_device(args.device)
    torch.cuda.synchronize()
    driver = Driver(args.device)
    piece = int(args.piece_gib * GIB) // driver.granularity * driver.granularity
    count = max(1, int(args.gib * GIB) // piece)
    region = Region(driver, piece, count)
    nbytes = piece * count
    copy_bytes = int(args.copy_gib * GIB)
    src = torch.empty(copy_bytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(copy_bytes, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    h2d_seconds(torch, dst, src, stream)  # warm
    report: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python3", *sys.argv]),
        "gpu": torch.cuda.get_device_name(args.device),
        "map_bytes": nbytes, "piece_bytes": piece, "copy_bytes": copy_bytes,
    }  # fmt: skip

    def rate(seconds: float, size: int) -> float:
        return round(size / seconds / 1e9, 1)

    report["first_map_s"] = round(region.map(), 4)
    alone = [h2d_seconds(torch, dst, src, stream) for _ in range(3)]
    report["h2d_alone_gbps"] = rate(min(alone), copy_bytes)
    waits: dict[str, list[float]] = {}
    for wait in (float(w) for w in args.waits.split(",")):
        runs = []
        for _ in range(2):
            region.release()
            time.sleep(wait)
            runs.append(round(region.map(), 4))
        waits[str(wait)] = runs
    report["map_after_own_free_s_by_wait"] = waits
    region.release()
    report["h2d_right_after_free_gbps"] = rate(h2d_seconds(torch, dst, src, stream), copy_bytes)
    report["map_after_that_s"] = round(region.map(), 4)
    region.release()
    time.sleep(2.0)
    copy = lambda: h2d_seconds(torch, dst, src, stream)  # noqa: E731
    report["while_mapping_after_2s"] = map_beside(region, copy, copy_bytes)
    region.release()
    report["while_mapping_right_after_free"] = map_beside(region, copy, copy_bytes)
    region.release()
    time.sleep(2.0)
    peer = Peer(nbytes, args.device)
    peer.free()
    report["map_after_peer_free_s"] = round(region.map(), 4)
    region.release()
    peer.end()
    time.sleep(2.0)
    report["map_after_peer_exit_2s_s"] = round(region.map(), 4)
    region.release()
    chunk = 256 << 20
    ways = {"h2d": (dst[:chunk], src[:chunk]), "d2h": (src[:chunk], dst[:chunk])}
    timelines: dict[str, Any] = {}
    for gib in (16, int(args.gib)):
        count_gib = max(1, gib * GIB // piece)
        for name, (to, frm) in ways.items():
            own = settled(Region(driver, piece, count_gib))
            timelines[f"{name}_after_own_free_{gib}gib"] = copy_timeline(
                torch, own.release, to, frm, stream=stream
            )
            peer = Peer(count_gib * piece, args.device)
            timelines[f"{name}_after_peer_free_{gib}gib"] = copy_timeline(
                torch, peer.free, to, frm, stream=stream
            )
            peer.end()
    report["copy_timelines"] = timelines
    report["scrub_gbps_after_own_free"] = rate(min(waits[min(waits, key=float)]), nbytes)
    emit(report, Path(args.out) if args.out else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
