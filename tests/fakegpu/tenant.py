"""Another tenant of a simulated GPU: a process outside every stage that takes device memory.

``python -m tests.fakegpu.tenant DIR NBYTES READY`` takes its context and ``NBYTES`` more on
the simulated device in ``DIR`` (an allocation that does not fit fails as CUDA's would), writes
``READY`` once it holds them, and keeps them until it is terminated: its record vanishes with
the process, as the driver frees a killed process's memory. :func:`start_tenant` runs it.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from tests.fakegpu import model
from tests.fakegpu.device import FakeGpu


def start_tenant(
    directory: Path, nbytes: int, ready: Path, timeout: float = 60.0
) -> subprocess.Popen[bytes]:
    """Start a tenant holding ``nbytes`` (plus its context) and return once it holds them."""
    ready.unlink(missing_ok=True)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.fakegpu.tenant", str(directory), str(nbytes), str(ready)]
    )
    deadline = time.monotonic() + timeout
    while not ready.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"the tenant exited {proc.returncode} before holding its memory")
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError("the tenant did not take its memory in time")
        time.sleep(0.05)
    return proc


def main(argv: list[str]) -> int:
    directory, nbytes, ready = Path(argv[0]), int(argv[1]), Path(argv[2])
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    gpu = FakeGpu(directory)
    device = gpu.device()
    me = model.Proc(psutil.Process().pid, psutil.Process().create_time())
    with gpu.locked():
        others = [p for pid, p in gpu.live().items() if pid != me.pid]
        me = model.touch(device, me, others)
        model.grow(device, me, others, nbytes)
        me = model.with_weights(me, nbytes)
        gpu.publish(me)
    ready.write_text(str(nbytes))
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    gpu.withdraw(me.pid)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
