"""A worker whose probe cannot find its own process on the device answers not-ok sleep ACKs.

In a container with its own PID namespace, on a driver that lists host pids, NVML may list no
pid the worker can recognise as itself (issue 19, item 7): its own figures then read 0, and a
sleep ACK built on them would be ok with 0 freed, proving nothing. The probe double here is
that NVML view (the fault cannot be caused on a CPU machine): it sees the device, never this
process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

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
