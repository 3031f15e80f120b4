"""The child processes of ``bench/gpu_e2e.py`` beside the stages: the copy limits, a ballast
tenant that holds device memory until signalled, and the NVML sampler."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

from bench.gpu_e2e_analysis import GiB

Json = dict[str, Any]


def child_limits() -> Json:
    from bench.sleep_limits import child_limits as limits

    return limits(4 * GiB)


def child_ballast(nbytes: int, ready: Path) -> None:
    import torch

    t = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    t.fill_(1)
    torch.cuda.synchronize()
    ready.write_text(str(nbytes))
    signal.sigwait({signal.SIGTERM, signal.SIGINT})


def child_sampler(out: Path, period: float, index: int) -> None:
    """NVML every ``period`` s: ``S t free used pid:bytes ...``; ``P pid cmdline`` once a pid."""
    import pynvml

    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(index)
    stop = False

    def _stop(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    seen: set[int] = set()
    with out.open("w", buffering=1 << 20) as fh:
        nxt = time.monotonic()
        while not stop:
            t = time.time()
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
            parts = [f"S {t:.6f} {int(mem.free)} {int(mem.used)}"]
            for p in procs:
                parts.append(f"{p.pid}:{int(p.usedGpuMemory or 0)}")
                if p.pid not in seen:
                    seen.add(p.pid)
                    try:
                        cmd = Path(f"/proc/{p.pid}/cmdline").read_bytes().replace(b"\0", b" ")
                        fh.write(f"P {p.pid} {cmd.decode(errors='replace').strip()}\n")
                    except OSError:
                        fh.write(f"P {p.pid} ?\n")
            fh.write(" ".join(parts) + "\n")
            nxt += period
            delay = nxt - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            else:
                nxt = time.monotonic()
