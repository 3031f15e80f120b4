"""A worker whose probe cannot find its own process on the device answers not-ok sleep ACKs.

In a container with its own PID namespace, on a driver that lists host pids, NVML may list no
pid the worker can recognise as itself (issue 19, item 7): its own figures then read 0, and a
sleep ACK built on them would be ok with 0 freed, proving nothing. The probe double here is
that NVML view (the fault cannot be caused on a CPU machine): it sees the device, never this
process.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from omnistage.worker.v1 import types_pb2
from omnistage_worker.config import WorkerConfig
from omnistage_worker.memory import PROBE_ENV, DeviceReading, Reading
from tests.worker.conftest import StartWorker

GiB = 1 << 30


class PidlessProbe:
    """NVML as seen from a PID namespace it cannot map: device figures, no process figures."""

    source = types_pb2.MEMORY_SOURCE_NVML

    def __init__(self, unverified: str) -> None:
        self.unverified = unverified

    def touch(self) -> None: ...

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        yield

    def release_cached(self) -> None: ...

    def read(self) -> Reading:
        device = DeviceReading("cuda:0", 0, "GPU-x", 0, 60 * GiB, 80 * GiB)
        return Reading((device,), self.source)

    def close(self) -> None: ...


def unresolved(config: WorkerConfig) -> PidlessProbe:
    return PidlessProbe("NVML does not list this process (pid 7) and it could not be recognised")


def resolved(config: WorkerConfig) -> PidlessProbe:
    return PidlessProbe("")


async def test_a_sleep_it_cannot_verify_is_not_ok(
    start_worker: StartWorker, lm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(PROBE_ENV, f"{__name__}:resolved")
    control = await start_worker(lm_dir, "ar", "transformers")
    assert (await control.sleep(1)).ok  # the same figures from a probe that found its pid

    monkeypatch.setenv(PROBE_ENV, f"{__name__}:unresolved")
    worker = await start_worker(lm_dir, "ar", "transformers")
    ack = await worker.sleep(1)
    assert not ack.ok and ack.freed_bytes == 0
    assert ack.error.startswith("the sleep cannot be verified: NVML does not list this process")
    status = await worker.status()
    assert status.state == types_pb2.WORKER_STATE_FAILED  # never reads as asleep: fenced


class _Listed:
    def __init__(self, pid: int, used: int) -> None:
        self.pid, self.usedGpuMemory = pid, used


def _probe_listing(*listings: dict[int, int]) -> Any:
    """An NvmlProbe of a vLLM worker whose NVML lists host pids (none of its own tree):
    ``listings`` are what NVML lists on successive calls (no driver here to list them)."""
    from omnistage_worker.memory.nvml import NvmlProbe

    probe = NvmlProbe.__new__(NvmlProbe)
    probe.pid, probe.include_children, probe.own_context = 424242, True, False
    probe.engine_pids, probe.unverified, probe._warned = set(), "", False
    calls = iter(listings)
    probe.processes = lambda: dict(next(calls))  # type: ignore[method-assign]
    return probe


def test_a_vllm_engine_is_adopted_only_as_its_own_tree_holds_the_device() -> None:
    """Issue 19: any pid that appeared on the device while the engine started was counted as
    the engine's, a tenant's process included. Now the pids that appeared must be as many as
    the processes of the worker's own tree holding the device open."""
    other = {1: 5 * GiB}
    alone = _probe_listing({**other, 77: 20 * GiB})
    alone.own_device_users = lambda: {12}
    alone.adopt_engine(set(other))
    assert alone.engine_pids == {77} and not alone.unverified
    crowded = _probe_listing({**other, 77: 20 * GiB, 78: 3 * GiB})  # a tenant started too
    crowded.own_device_users = lambda: {12}
    crowded.adopt_engine(set(other))
    assert crowded.engine_pids == set()
    assert "2 pids appeared" in crowded.unverified and "1 processes of its own tree" in (
        crowded.unverified
    )
    nothing = _probe_listing(dict(other))
    nothing.own_device_users = lambda: {12}
    nothing.adopt_engine(set(other))
    assert nothing.engine_pids == set() and nothing.unverified


def test_own_device_users_are_the_trees_processes_with_the_device_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Read from /proc: a child of this process holding the device open counts; a child
    without it does not (a real /dev/nvidia* needs a GPU: a file stands in for the device
    path, through the pattern the probe matches)."""
    import re
    import subprocess
    import sys

    from omnistage_worker.memory import nvml

    fake_dev = tmp_path / "nvidia3"
    fake_dev.write_text("")
    monkeypatch.setattr(nvml, "_DEV_NVIDIA", re.compile(re.escape(str(fake_dev))))
    probe = _probe_listing()
    probe.pid, probe.minor = os.getpid(), None
    code = f"import time; f = open({str(fake_dev)!r}); print(flush=True); time.sleep(60)"
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert holder.stdout is not None
        holder.stdout.readline()  # the device is open from here on
        assert probe.own_device_users() == {holder.pid}
    finally:
        for child in (holder, idle):
            child.kill()
            child.wait()
