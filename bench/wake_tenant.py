"""A tenant that takes a real GPU's room between the operator's gate and a wake's copy.

Used by ``bench/gpu_wake_oom_operator.py``. The window between the operator's gate (its last
free-memory reading) and the worker's copy is a few milliseconds inside one round, too short for
another process to hit by watching from outside. So the worker's launcher (the bench's
``omnistage-worker`` script, its "image") calls :func:`install` first: every WakeUp is logged
(``wakes.log``, one wall-clock time per line) and, while the bench has left an ``armed`` file,
the wake stops right before its copy until the tenant process (:func:`tenant`, a real CUDA
process started ahead with its context up) has taken all the device's free memory but
``leave`` bytes. The out-of-memory error the copy then meets is PyTorch's own.

Files in the shared folder: ``armed`` (bench: the next wake meets the tenant), ``go`` (worker:
take it now), ``taken`` (tenant: holding, its byte count), ``leave`` (bench: let it go; the
tenant removes ``taken`` and then ``leave``), ``stop``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

WAIT_S = 60.0


def install(directory: str) -> None:
    """In the worker process: wrap the wake's allocation figure (called right before the copy)
    so that an armed tenant arrives there, and log every WakeUp."""
    from omnistage_worker.control import sleep_wake

    folder = Path(directory)
    original = getattr(sleep_wake, "wake_allocation")  # noqa: B009 (not exported)

    def before_copy(controller: Any) -> list[int]:
        allocation: list[int] = original(controller)
        with (folder / "wakes.log").open("a") as fh:
            fh.write(f"{time.time():.6f}\n")
        try:
            os.replace(folder / "armed", folder / "go")
        except FileNotFoundError:
            return allocation
        deadline = time.monotonic() + WAIT_S
        while not (folder / "taken").exists():
            if time.monotonic() > deadline:
                raise RuntimeError("the bench's tenant did not take the room")
            time.sleep(0.001)
        return allocation

    setattr(sleep_wake, "wake_allocation", before_copy)  # noqa: B010 (not exported)


def tenant(directory: Path, leave: int) -> None:
    """A CUDA process that, on each ``go``, takes all free memory but ``leave`` bytes and
    holds it until ``leave`` is written."""
    import torch

    torch.empty(1, device="cuda:0")  # the context up before any wake
    (directory / "tenant.up").write_text(str(os.getpid()))
    while not (directory / "stop").exists():
        if not (directory / "go").exists():
            time.sleep(0.0005)
            continue
        free = int(torch.cuda.mem_get_info(0)[0])
        take = max(0, free - leave)
        block = torch.empty(take, dtype=torch.uint8, device="cuda:0")
        torch.cuda.synchronize()
        (directory / "taken").write_text(str(take))
        (directory / "go").unlink()
        while not (directory / "leave").exists() and not (directory / "stop").exists():
            time.sleep(0.002)
        del block
        torch.cuda.empty_cache()
        (directory / "taken").unlink()
        (directory / "leave").unlink(missing_ok=True)


class TenantFiles:
    """The bench's side of the handshake."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        directory.mkdir(parents=True, exist_ok=True)
        for name in ("armed", "go", "taken", "leave", "stop", "wakes.log", "tenant.up"):
            (directory / name).unlink(missing_ok=True)

    def arm(self) -> None:
        (self.dir / "armed").write_text("")

    def taken_bytes(self) -> int:
        path = self.dir / "taken"
        return int(path.read_text() or 0) if path.exists() else 0

    def release(self, timeout: float = WAIT_S) -> None:
        """The tenant leaves; returns once its memory is freed (no-op when it holds none)."""
        if not (self.dir / "taken").exists():
            return
        (self.dir / "leave").write_text("")
        deadline = time.monotonic() + timeout
        while (self.dir / "leave").exists():
            if time.monotonic() > deadline:
                raise TimeoutError("the tenant did not leave")
            time.sleep(0.005)

    def stop(self) -> None:
        (self.dir / "armed").unlink(missing_ok=True)
        (self.dir / "stop").write_text("")

    def wakes(self) -> list[float]:
        path = self.dir / "wakes.log"
        return [float(x) for x in path.read_text().split()] if path.exists() else []


if __name__ == "__main__":
    tenant(Path(sys.argv[1]), int(sys.argv[2]))
