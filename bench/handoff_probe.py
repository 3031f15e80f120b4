"""Probe: an overlapped hand-over with the device memory handed over instead of freed.

``bench/overlap.py`` reads 0.66-0.68 of the serial copy bound, and the incoming wake trails the
outgoing sleep by 40-50 ms, about what the driver's cleaning of the memory given back costs the
host -> device copies beside it (``bench/results/scrub_probe.json``). Two processes, A (outgoing)
and B (incoming), ``--gib`` GiB in ``--piece-mib`` pieces, A copying its pieces to the host
while B copies its own from the host, piece by piece behind A, in two modes:

- ``free``: A releases each piece once its copy is done and tells B, which maps a new piece
  (``cuMemCreate``): what the worker does today;
- ``handoff``: A's pieces are made exportable (a POSIX file descriptor each); once a piece is
  copied A unmaps it, releases its own handle and sends the descriptor (``SCM_RIGHTS``); B
  imports it and maps the same physical memory: nothing is freed, so nothing is cleaned;
- ``free_kernel`` (asked for with ``--modes``): as ``free``, B's copies made by a kernel that
  reads the pinned host buffer through its unified address instead of by the copy engine, which
  the driver's cleaning shares (``bench/results/vllm_stage.md``: right after a release such a
  copy lost less than the copy engine's, 51 GB/s at best alone).

Per run: seconds from the start to B's last copy done, against the serial bound (bytes / D2H +
bytes / H2D, both measured alone in this run by A and B), and NVML's per-process figures of
both right after (who is charged for a handed-over piece). It prints and writes one JSON.

    PYTHONPATH=$PWD/worker_image/src:$PWD python3 -m bench.handoff_probe --gib 16 \
        --out $OUT/handoff_probe.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.reporting import emit
from omnistage_worker.engine.vmm_driver import VmmDriver

Json = dict[str, Any]
GIB, MIB = 1 << 30, 1 << 20


def exporting_driver() -> VmmDriver:
    """The worker's VMM driver calls for device 0, its pieces exportable (a CUDA context
    first)."""
    import torch

    torch.cuda.init()  # type: ignore[no-untyped-call]
    torch.empty(1, device="cuda:0")  # the context
    return VmmDriver(0, exportable=True)


def view(ptr: int, nbytes: int) -> Any:
    import torch

    from omnistage_worker.engine.vmm import _Interface

    return torch.as_tensor(_Interface(ptr, nbytes), device="cuda:0")


def expect(sock: socket.socket, word: bytes) -> None:
    """Read exactly ``word`` (a control message; the piece messages are one byte each)."""
    got = b""
    while len(got) < len(word):
        chunk = sock.recv(len(word) - len(got))
        if not chunk:
            raise RuntimeError(f"peer closed while {word!r} was expected")
        got += chunk
    if got != word:
        raise RuntimeError(f"expected {word!r}, got {got!r}")


def nvml_by_pid() -> dict[int, int]:
    import pynvml

    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    return {
        int(p.pid): int(p.usedGpuMemory or 0)
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)
    }


def role_a(sock: socket.socket, size: int, piece: int, modes: list[str]) -> Json:
    """Outgoing: per run make and fill the pieces, then copy each out and give it up."""
    import torch

    ex = exporting_driver()
    count = size // piece
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    out: Json = {"pid": os.getpid(), "runs": []}
    for mode in modes:
        base = ex.reserve(size)
        handles = [ex.map_new(base + k * piece, piece) for k in range(count)]
        fds = [ex.export(h) for h in handles] if mode == "handoff" else []
        view(base, size).fill_(7)
        torch.cuda.synchronize()
        if "d2h_alone_s" not in out:
            t = time.perf_counter()
            host.copy_(view(base, size))
            out["d2h_alone_s"] = time.perf_counter() - t
        expect(sock, b"ready")
        time.sleep(1.0)  # earlier releases cleaned
        sock.send(b"go")
        events = []
        with torch.cuda.stream(stream):
            for k in range(count):
                host[k * piece : (k + 1) * piece].copy_(
                    view(base + k * piece, piece), non_blocking=True
                )
                events.append(torch.cuda.Event())  # type: ignore[no-untyped-call]
                events[-1].record()
        for k in range(count):
            events[k].synchronize()
            ex.unmap_release(base + k * piece, piece, handles[k])
            if mode == "handoff":
                socket.send_fds(sock, [b"p"], [fds[k]])
                os.close(fds[k])
            else:
                sock.send(b"p")
        expect(sock, b"done")
        out["runs"].append({"mode": mode, "nvml_after": nvml_by_pid()})
        ex.free_range(base, size)
        sock.send(b"ok")
    return out


def role_b(sock: socket.socket, size: int, piece: int, modes: list[str]) -> Json:
    """Incoming: per run take each piece as A gives it up and copy into it."""
    import torch

    ex = exporting_driver()
    count = size // piece
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    host.fill_(9)
    host_dev = view(host.data_ptr(), size)  # the same host bytes as a CUDA tensor (unified)
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    tmp = torch.empty(size, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    t = time.perf_counter()
    tmp.copy_(host)
    torch.cuda.synchronize()
    out: Json = {"pid": os.getpid(), "h2d_alone_s": time.perf_counter() - t, "runs": []}
    del tmp
    torch.cuda.empty_cache()
    for mode in modes:
        base = ex.reserve(size)
        handles = []
        sock.send(b"ready")
        expect(sock, b"go")
        t0 = time.perf_counter()
        with torch.cuda.stream(stream):
            for k in range(count):
                if mode == "handoff":
                    _, fds, _, _ = socket.recv_fds(sock, 1, 1)
                    handle = ex.map_imported(base + k * piece, piece, fds[0])
                    os.close(fds[0])
                else:
                    sock.recv(1)
                    handle = ex.map_new(base + k * piece, piece)
                handles.append(handle)
                dst = view(base + k * piece, piece)
                if mode == "free_kernel":  # the loads cross the bus; no copy engine
                    src = host_dev[k * piece : (k + 1) * piece].view(torch.int64)
                    torch.bitwise_or(src, 0, out=dst.view(torch.int64))
                else:
                    dst.copy_(host[k * piece : (k + 1) * piece], non_blocking=True)
        stream.synchronize()
        seconds = time.perf_counter() - t0
        check = bool(view(base, size)[:: 1 << 20].eq(9).all().item())
        sock.send(b"done")
        nvml = nvml_by_pid()
        expect(sock, b"ok")
        for k, handle in enumerate(handles):
            ex.unmap_release(base + k * piece, piece, handle)
        ex.free_range(base, size)
        out["runs"].append(
            {"mode": mode, "seconds": seconds, "bytes_intact": check, "nvml_during": nvml}
        )
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=16.0)
    p.add_argument("--piece-mib", type=int, default=256)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--modes", default="free,handoff", help="free, handoff, free_kernel")
    p.add_argument("--out", type=Path)
    p.add_argument("--role", choices=("a", "b"))
    p.add_argument("--fd", type=int)
    a = p.parse_args()
    piece = a.piece_mib * MIB
    size = int(a.gib * GIB) // piece * piece
    names = a.modes.split(",")
    unknown = set(names) - {"free", "handoff", "free_kernel"}
    if unknown:
        p.error(f"unknown modes {sorted(unknown)}")
    modes = names * a.runs
    if a.role:
        sock = socket.socket(fileno=a.fd)
        result = (role_a if a.role == "a" else role_b)(sock, size, piece, modes)
        print(json.dumps(result))
        return 0
    sa, sb = socket.socketpair()
    children = []
    for role, end in (("a", sa), ("b", sb)):
        cmd = [sys.executable, "-m", "bench.handoff_probe", "--role", role]
        cmd += ["--fd", str(end.fileno()), "--gib", str(a.gib)]
        cmd += ["--piece-mib", str(a.piece_mib), "--runs", str(a.runs), "--modes", a.modes]
        children.append(
            subprocess.Popen(cmd, pass_fds=(end.fileno(),), stdout=subprocess.PIPE, text=True)
        )
    outs = [json.loads(c.communicate(timeout=900)[0].strip().splitlines()[-1]) for c in children]
    ra, rb = outs
    d2h, h2d = size / ra["d2h_alone_s"], size / rb["h2d_alone_s"]
    bound = size / d2h + size / h2d
    runs = []
    for x, y in zip(ra["runs"], rb["runs"], strict=True):
        after = x["nvml_after"]  # JSON keys: the pids as strings
        runs.append(
            {
                "mode": y["mode"],
                "seconds": y["seconds"],
                "of_serial_bound": y["seconds"] / bound,
                "bytes_intact": y["bytes_intact"],
                "nvml_a_after": after.get(str(ra["pid"])),
                "nvml_b_during": y["nvml_during"].get(str(rb["pid"])),
                "nvml_during": y["nvml_during"],
            }
        )
    report = {
        "benchmark": "handoff_probe",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "bytes": size,
        "piece_bytes": piece,
        "pids": {"a": ra["pid"], "b": rb["pid"]},
        "d2h_alone_gbps": d2h / 1e9,
        "h2d_alone_gbps": h2d / 1e9,
        "serial_bound_s": bound,
        "runs": runs,
    }
    for mode in names:
        seconds = sorted(r["seconds"] for r in runs if r["mode"] == mode)
        report[f"{mode}_median_of_serial_bound"] = seconds[len(seconds) // 2] / bound
    emit(report, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
