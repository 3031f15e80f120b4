"""Probe: which way of moving a vLLM stage's weights back reaches the copy limit at a wake.

A vLLM stage's level-1 wake on an H200 (bench/results/vllm_stage.md) maps 103 weight
allocations and copies 9.2 GB into them from one pinned host buffer, and maps a 109.5 GiB KV
cache in 512 MiB pieces; rested it ran at 0.77-0.81 of H2D, right after its own sleep at 0.47
(the driver cleaning what the sleep released, ``scrub_probe.json``). This rebuilds the same
layout with the driver's own calls (no vLLM: the weights of the bench's Llama as vLLM fuses
them, the KV cache as 4.2 GiB allocations in pieces) and times a wake several ways, rested
(``--rest-s`` after the sleep) and right after the sleep:

- ``ce``: as the engine does now: map a weight allocation, issue its ``cudaMemcpyAsync``,
  the next; then the KV cache's pieces; one wait;
- ``ce_kv_thread``: the KV cache mapped on a second thread from the start;
- ``sm`` / ``sm_kv_thread``: the same, each copy made by a kernel reading the pinned host
  buffer through its device address (no copy engine; the driver cleans with those);
- ``ce_kv_first`` / ``ce_kv_after`` / ``ce_weights_first``: the KV cache mapped before the
  weights, after their copies ended, or every weight mapped before the first copy;
- ``ce_kv_create_first`` / ``ce_kv_map_after``: the KV cache's physical memory created before
  the weights (mapped after them), or created during the copies and mapped once they ended;
- ``maps_only``: every map, no copy in flight (the KV cache's creation timed apart);
- ``ce_premapped`` / ``sm_premapped``: the copies alone into memory already mapped: each way's
  limit with this layout.

``--kv-piece-mib`` sets the KV cache's piece, ``--kv-access alloc`` makes one access call per KV
allocation, ``--host registered`` backs the weights up in the engine's own host buffer
(``engine/host_memory.HostBuffer``) instead of torch's pinned memory; ``--model``,
``--weight-allocs`` and ``--weight-bytes`` give another layout (``bench/vllm_wake_floor.py``
passes a stage's own). One physical allocation mapped under several weight ranges is not among
the ways: the driver refuses a mapping at an offset into an allocation (``cuMemMap``: 801, not
supported).

Beside them: the H2D limit (one 4 GiB copy), the same copy by a kernel, and how long mapping
the whole stage again takes right after releasing it (the cleaning's bound on any wake right
after a sleep). Every wake's bytes are checked against the host buffer. One JSON.

    PYTHONPATH=$PWD/worker_image/src:$PWD python3 -m bench.vllm_wake_probe --out $OUT/p.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from bench.cumem_map_probe import GIB, Driver
from bench.reporting import emit
from omnistage_worker.engine.host_memory import HostBuffer
from omnistage_worker.engine.vmm import piece_spans

MIB = 1 << 20


def weight_sizes(
    layers: int = 24,
    hidden: int = 4096,
    inter: int = 11008,
    vocab: int = 32000,
    *,
    allocs: int = 103,
    total: int = 0,
) -> list[int]:
    """Bytes of each weight allocation of a Llama as vLLM fuses and allocates it (bf16; qkv and
    gate_up fused; torch's segments rounded up to 2 MiB): the matrices, then small segments (the
    norms and what else vLLM keeps in its "weights" pool) up to ``allocs`` allocations and
    ``total`` bytes (an engine's own count and bytes: its sleep's copies), 20 MiB each when
    ``total`` is 0 (pure)."""
    kv = hidden // 4
    per_layer = [(hidden + 2 * kv) * hidden, hidden * hidden, 2 * inter * hidden, inter * hidden]
    big = [vocab * hidden] + [n for _ in range(layers) for n in per_layer] + [vocab * hidden]
    sizes = [align_2m(2 * n) for n in big]
    small = max(allocs - len(sizes), 0)
    if small:
        rest = total - sum(sizes) if total else small * 20 * MIB
        sizes += [align_2m(max(rest // small, 2 * MIB))] * small
    return sizes


def align_2m(n: int) -> int:
    return -(-n // (2 * MIB)) * (2 * MIB)


def device_view(ptr: int, nbytes: int) -> torch.Tensor:
    """A CUDA uint8 tensor over ``nbytes`` at ``ptr`` (device memory, or pinned host memory
    through its unified address)."""
    iface = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}
    holder = type("Interface", (), {"__cuda_array_interface__": iface})()
    return torch.as_tensor(holder, device="cuda")


class Stage:
    """The emulated stage: weight allocations backed up in one pinned buffer, a KV cache."""

    def __init__(
        self,
        driver: Driver,
        weights: list[int],
        kv_allocs: int,
        kv_bytes: int,
        kv_piece: int,
        *,
        registered: bool,
    ) -> None:
        self.driver = driver
        gran = driver.granularity
        self.weights = [(driver.reserve(n), n) for n in weights]
        self.kv_spans = piece_spans(kv_bytes, kv_piece, gran)
        kv_size = sum(n for _, n in self.kv_spans)
        self.kv = [driver.reserve(kv_size) for _ in range(kv_allocs)]
        self.offsets, offset = [], 0
        for _, n in self.weights:
            self.offsets.append(offset)
            offset += n
        if registered:  # as the engine keeps it: an anonymous mapping page-locked by the driver
            self.kept = HostBuffer(offset, pin=True)
            self.host = self.kept.tensor
        else:
            self.host = torch.empty(offset, dtype=torch.uint8, pin_memory=True)
        for start in range(0, offset, GIB):  # random bytes, made on the device
            part = self.host[start : start + GIB]
            part.copy_(torch.randint(0, 255, (part.numel(),), dtype=torch.uint8, device="cuda"))
        self.host_dev = device_view(self.host.data_ptr(), offset)
        self.handles: dict[int, int] = {}
        self.stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        self.weight_bytes = offset
        self.maps_s = 0.0
        self.access_per_alloc = False
        self.kv_create_s = 0.0
        self.kv_total = kv_size * kv_allocs

    def map_weight(self, i: int) -> None:
        ptr, n = self.weights[i]
        self.handles[ptr] = self.driver.map_new(ptr, n)

    def map_kv(self) -> None:
        for base in self.kv:
            if not self.access_per_alloc:
                for off, n in self.kv_spans:
                    self.handles[base + off] = self.driver.map_new(base + off, n)
                continue
            for off, n in self.kv_spans:  # created and mapped piece by piece, access set once
                handle = self.driver.create(n)
                self.driver.map(base + off, n, handle)
                self.handles[base + off] = handle
            self.driver.set_access(base, sum(n for _, n in self.kv_spans))

    def copy(self, i: int, kernel: bool) -> None:
        ptr, n = self.weights[i]
        src = self.host_dev[self.offsets[i] : self.offsets[i] + n]
        with torch.cuda.stream(self.stream):
            dst = device_view(ptr, n)
            if kernel:  # an elementwise kernel: its loads go to host memory over the bus
                torch.bitwise_or(src.view(torch.int64), 0, out=dst.view(torch.int64))
            else:
                dst.copy_(self.host[self.offsets[i] : self.offsets[i] + n], non_blocking=True)

    def sleep(self) -> None:
        """Back up the weights (D2H), release the KV cache while they copy, then the weights."""
        torch.cuda.synchronize()
        with torch.cuda.stream(self.stream):
            for i, (ptr, n) in enumerate(self.weights):
                host = self.host[self.offsets[i] : self.offsets[i] + n]
                host.copy_(device_view(ptr, n), non_blocking=True)
        for base in self.kv:
            for off, n in self.kv_spans:
                self.driver.unmap_release(base + off, n, self.handles.pop(base + off))
        self.stream.synchronize()
        for ptr, n in self.weights:
            self.driver.unmap_release(ptr, n, self.handles.pop(ptr))

    def wake(self, way: str) -> float:
        kernel = way.startswith("sm")
        began = time.perf_counter()
        count = len(self.weights)
        if way.endswith("premapped"):
            for i in range(count):
                self.copy(i, kernel)
        elif way in ("ce_kv_create_first", "ce_kv_map_after"):
            handles = self.create_kv() if way == "ce_kv_create_first" else []
            self.restore(kernel)
            if not handles:
                handles = self.create_kv()
                self.stream.synchronize()
            self.attach_kv(handles)
        elif way == "maps_only":
            for i in range(count):
                self.map_weight(i)
            created = time.perf_counter()
            handles = self.create_kv()
            self.kv_create_s = time.perf_counter() - created
            self.attach_kv(handles)
            for i in range(count):
                self.copy(i, kernel)
            self.maps_s = time.perf_counter() - began
            self.stream.synchronize()
            return self.maps_s
        elif way.endswith("weights_first"):
            for i in range(count):
                self.map_weight(i)
            for i in range(count):
                self.copy(i, kernel)
            self.map_kv()
        elif way.endswith("kv_first"):
            self.map_kv()
            self.restore(kernel)
        elif way.endswith("kv_after"):
            self.restore(kernel)
            self.stream.synchronize()
            self.map_kv()
        elif way.endswith("kv_thread"):
            beside = threading.Thread(target=self.map_kv_beside)
            beside.start()
            self.restore(kernel)
            beside.join()
        else:
            self.restore(kernel)
            self.map_kv()
        self.maps_s = time.perf_counter() - began
        self.stream.synchronize()
        return time.perf_counter() - began

    def create_kv(self) -> list[int]:
        return [self.driver.create(n) for _ in self.kv for _, n in self.kv_spans]

    def attach_kv(self, handles: list[int]) -> None:
        """Map the KV cache's pieces onto ``handles`` (made by :meth:`create_kv`)."""
        it = iter(handles)
        for base in self.kv:
            for off, n in self.kv_spans:
                handle = next(it)
                self.driver.map(base + off, n, handle)
                self.driver.set_access(base + off, n)
                self.handles[base + off] = handle

    def restore(self, kernel: bool) -> None:
        for i in range(len(self.weights)):
            self.map_weight(i)
            self.copy(i, kernel)

    def map_kv_beside(self) -> None:
        """:meth:`map_kv` on a thread of its own (the context made current there first)."""
        self.driver.make_current()
        self.map_kv()

    def check(self) -> bool:
        """Whether every weight allocation holds its backup's bytes (first and last MiB)."""
        for i, (ptr, n) in enumerate(self.weights):
            dev = device_view(ptr, n)
            host = self.host[self.offsets[i] : self.offsets[i] + n]
            for part in (slice(0, MIB), slice(n - MIB, n)):
                if not torch.equal(dev[part].cpu(), host[part]):
                    return False
        return True

    def release_all(self) -> None:
        torch.cuda.synchronize()
        for ptr in list(self.handles):
            n = self.size_at(ptr)
            self.driver.unmap_release(ptr, n, self.handles.pop(ptr))

    def size_at(self, ptr: int) -> int:
        for p, n in self.weights:
            if p == ptr:
                return n
        for base in self.kv:
            for off, n in self.kv_spans:
                if base + off == ptr:
                    return n
        raise KeyError(ptr)

    def map_all(self) -> float:
        began = time.perf_counter()
        for i in range(len(self.weights)):
            self.map_weight(i)
        self.map_kv()
        return time.perf_counter() - began


def timed(fn: Callable[[], Any], stream: Any) -> float:
    torch.cuda.synchronize()
    began = time.perf_counter()
    fn()
    stream.synchronize()
    torch.cuda.synchronize()
    return time.perf_counter() - began


def limits(nbytes: int) -> dict[str, float]:
    """H2D by the copy engine and by a kernel, ``nbytes`` from pinned memory, best of 3."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    kept = HostBuffer(nbytes, pin=True)
    registered = kept.tensor
    src_dev = device_view(src.data_ptr(), nbytes)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]

    def ce() -> None:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def sm() -> None:
        with torch.cuda.stream(stream):
            torch.bitwise_or(src_dev.view(torch.int64), 0, out=dst.view(torch.int64))

    def ce_registered() -> None:
        with torch.cuda.stream(stream):
            dst.copy_(registered, non_blocking=True)

    def d2d_api() -> None:
        with torch.cuda.stream(stream):
            dst.copy_(src_dev, non_blocking=True)

    out: dict[str, Any] = {}
    for name, fn in (
        ("h2d_ce", ce),
        ("h2d_sm", sm),
        ("h2d_copy_of_unified_view", d2d_api),
        ("h2d_ce_registered", ce_registered),
    ):
        try:
            fn()
            best = min(timed(fn, stream) for _ in range(3))
        except Exception as exc:  # a kernel over host memory may be refused: say so
            out[name + "_error"] = f"{type(exc).__name__}: {exc}"
            continue
        out[name + "_gbps"] = round(nbytes / best / 1e9, 2)
    kept.release()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-allocs", type=int, default=26)
    parser.add_argument("--kv-gib", type=float, default=4.21, help="GiB of each KV allocation")
    parser.add_argument("--model", default="24,4096,11008,32000",
                        help="the Llama's layers,hidden,intermediate,vocab")  # fmt: skip
    parser.add_argument("--weight-allocs", type=int, default=103)
    parser.add_argument("--weight-bytes", type=int, default=0, help="0: small segments of 20 MiB")
    parser.add_argument("--rest-s", type=float, default=2.0)
    parser.add_argument("--kv-piece-mib", type=int, default=512)
    parser.add_argument("--when", default="rested,right_after")
    parser.add_argument("--host", choices=("torch", "registered"), default="torch")
    parser.add_argument("--kv-access", choices=("piece", "alloc"), default="piece")
    parser.add_argument("--repeats", type=int, default=2)
    ways = "ce,ce_kv_thread,sm,sm_kv_thread,ce_premapped,sm_premapped"
    parser.add_argument("--ways", default=ways)
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.cuda.set_device(0)
    torch.cuda.synchronize()
    report: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python3", *sys.argv]),
        "gpu": torch.cuda.get_device_name(0),
        "limits": limits(4 * GIB),
    }
    torch.cuda.empty_cache()
    print(report, flush=True)
    driver = Driver(0)
    kv_bytes, kv_piece = int(args.kv_gib * GIB), args.kv_piece_mib * MIB
    registered = args.host == "registered"
    layers, hidden, inter, vocab = (int(x) for x in args.model.split(","))
    sizes = weight_sizes(
        layers, hidden, inter, vocab, allocs=args.weight_allocs, total=args.weight_bytes
    )
    stage = Stage(driver, sizes, args.kv_allocs, kv_bytes, kv_piece, registered=registered)
    stage.access_per_alloc = args.kv_access == "alloc"
    report["weight_bytes"], report["weight_allocs"] = stage.weight_bytes, len(stage.weights)
    report["kv_bytes"], report["kv_pieces"] = stage.kv_total, len(stage.kv) * len(stage.kv_spans)
    stage.map_all()
    for i in range(len(stage.weights)):
        stage.copy(i, kernel=False)
    torch.cuda.synchronize()
    h2d = report["limits"]["h2d_ce_gbps"]
    results: dict[str, Any] = {}
    for when in args.when.split(","):
        for way in args.ways.split(","):
            if when == "right_after" and way.endswith("premapped"):
                continue
            runs, maps, ok = [], [], True
            for _ in range(args.repeats):
                if way.endswith("premapped"):
                    torch.cuda.synchronize()
                    time.sleep(0.2)
                    runs.append(stage.wake(way))
                    ok = ok and stage.check()
                    continue
                stage.sleep()
                if when == "rested":
                    time.sleep(args.rest_s)
                runs.append(stage.wake(way))
                maps.append(round(stage.maps_s, 4))
                if way == "maps_only":
                    maps.append(round(stage.kv_create_s, 4))
                ok = ok and stage.check()
            med = statistics.median(runs)
            results[f"{when}/{way}"] = {
                "seconds": [round(r, 4) for r in runs],
                "maps_returned_s": maps,
                "of_h2d": round(stage.weight_bytes / h2d / 1e9 / med, 3),
                "bytes_ok": ok,
            }
            print(f"{when}/{way}", results[f"{when}/{way}"], flush=True)
    report["wakes"] = results
    stage.release_all()
    time.sleep(args.rest_s)
    stage.map_all()
    stage.release_all()
    report["remap_whole_stage_right_after_release_s"] = round(stage.map_all(), 4)
    stage.release_all()
    time.sleep(args.rest_s)
    report["remap_whole_stage_rested_s"] = round(stage.map_all(), 4)
    stage.release_all()
    emit(report, Path(args.out) if args.out else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
