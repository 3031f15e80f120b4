"""Probe: who NVML charges for device memory handed from one process to another, at each step.

A hand-over that passes physical memory (``bench/handoff_probe.py``'s ``handoff`` mode) keeps
its promise only if the outgoing process's measured use falls once it has given a piece up,
before the incoming one has taken it (the incoming worker may take it only after the fall is
reported). Process A makes ``--pieces`` exportable pieces of ``--piece-mib`` MiB, fills them,
exports each as a file descriptor, unmaps and releases its own handles, then sends the
descriptors to B over a Unix socket; B receives them, imports them, maps them, checks the bytes
and releases them. After each step both processes' NVML figures and the device's used memory
are read (by A, the step's owner waiting for the other).

    PYTHONPATH=$PWD/worker_image/src:$PWD python3 -m bench.handoff_charge_probe \
        --out $OUT/handoff_charge_probe.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.handoff_probe import expect, exporting_driver, nvml_by_pid, view

Json = dict[str, Any]
MIB = 1 << 20


def reading(a: int, b: int) -> Json:
    """Both processes' NVML figures and the device's used memory."""
    import pynvml

    pynvml.nvmlInit()
    by_pid = nvml_by_pid()
    used = int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used)
    return {"a": by_pid.get(a, 0), "b": by_pid.get(b, 0), "device_used": used}


def role_a(sock: socket.socket, count: int, piece: int) -> Json:
    ex = exporting_driver()
    b_pid = int(sock.recv(16).decode())
    me = os.getpid()
    steps: list[Json] = [{"step": "start", **reading(me, b_pid)}]
    base = ex.reserve(count * piece)
    handles = [ex.map_new(base + k * piece, piece) for k in range(count)]
    view(base, count * piece).fill_(7)
    import torch

    torch.cuda.synchronize()
    steps.append({"step": "a_mapped", **reading(me, b_pid)})
    fds = [ex.export(h) for h in handles]
    steps.append({"step": "a_exported", **reading(me, b_pid)})
    for k, h in enumerate(handles):
        ex.unmap_release(base + k * piece, piece, h)
    steps.append({"step": "a_unmapped_released_fds_open", **reading(me, b_pid)})
    for fd in fds:
        socket.send_fds(sock, [b"p"], [fd])
        os.close(fd)
    steps.append({"step": "a_sent_closed_b_not_received", **reading(me, b_pid)})
    sock.send(b"recv")
    for step in ("b_received", "b_imported", "b_mapped", "b_released_fds_kept"):
        expect(sock, b"ok")
        steps.append({"step": step, **reading(me, b_pid)})
        sock.send(b"next")
    back = [socket.recv_fds(sock, 1, 1)[1][0] for _ in range(count)]
    expect(sock, b"ok")
    steps.append({"step": "b_sent_back_closed", **reading(me, b_pid)})
    again = [ex.import_fd(fd) for fd in back]
    for fd in back:
        os.close(fd)
    for k, h in enumerate(again):
        ex.map(base + k * piece, piece, h)
        ex.set_access(base + k * piece, piece)
    intact = bool(view(base, count * piece)[::MIB].eq(7).all().item())
    steps.append({"step": "a_reimported_mapped", **reading(me, b_pid)})
    for k, h in enumerate(again):
        ex.unmap_release(base + k * piece, piece, h)
    steps.append({"step": "a_released_all", **reading(me, b_pid)})
    sock.send(b"next")
    ex.free_range(base, count * piece)
    return {"pid": me, "b_pid": b_pid, "steps": steps, "bytes_intact_back": intact}


def role_b(sock: socket.socket, count: int, piece: int) -> Json:
    ex = exporting_driver()
    sock.send(str(os.getpid()).encode().ljust(16))
    fds = [socket.recv_fds(sock, 1, 1)[1][0] for _ in range(count)]
    expect(sock, b"recv")
    sock.send(b"ok")
    expect(sock, b"next")
    handles = [ex.import_fd(fd) for fd in fds]  # the descriptors kept, as a worker keeps them
    sock.send(b"ok")
    expect(sock, b"next")
    base = ex.reserve(count * piece)
    for k, h in enumerate(handles):
        ex.map(base + k * piece, piece, h)
        ex.set_access(base + k * piece, piece)
    intact = bool(view(base, count * piece)[::MIB].eq(7).all().item())
    sock.send(b"ok")
    expect(sock, b"next")
    for k, h in enumerate(handles):
        ex.unmap_release(base + k * piece, piece, h)
    ex.free_range(base, count * piece)
    sock.send(b"ok")
    expect(sock, b"next")
    for fd in fds:  # handed back to A, as the next hand-over does
        socket.send_fds(sock, [b"p"], [fd])
        os.close(fd)
    sock.send(b"ok")
    expect(sock, b"next")
    return {"pid": os.getpid(), "bytes_intact": intact}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pieces", type=int, default=4)
    p.add_argument("--piece-mib", type=int, default=1024)
    p.add_argument("--out", type=Path)
    p.add_argument("--role", choices=("a", "b"))
    p.add_argument("--fd", type=int)
    a = p.parse_args()
    piece = a.piece_mib * MIB
    if a.role:
        sock = socket.socket(fileno=a.fd)
        sock.settimeout(60)
        result = (role_a if a.role == "a" else role_b)(sock, a.pieces, piece)
        print(json.dumps(result))
        return 0
    ends = socket.socketpair()
    procs = []
    for role, end in zip(("a", "b"), ends, strict=True):
        cmd = [sys.executable, "-m", "bench.handoff_charge_probe", "--role", role]
        cmd += ["--fd", str(end.fileno()), "--pieces", str(a.pieces)]
        cmd += ["--piece-mib", str(a.piece_mib)]
        procs.append(subprocess.Popen(cmd, pass_fds=[end.fileno()], stdout=subprocess.PIPE))
    outs = [
        json.loads(proc.communicate(timeout=120)[0].decode().strip().splitlines()[-1])
        for proc in procs
    ]
    result = {
        "at": datetime.now(UTC).isoformat(timespec="seconds"),
        "pieces": a.pieces,
        "piece_bytes": piece,
        **outs[0],
        "bytes_intact": outs[1]["bytes_intact"],
    }
    print(json.dumps(result, indent=1))
    if a.out:
        a.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
