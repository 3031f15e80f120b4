"""A wake that runs out of device memory mid-copy, on a real worker process and the simulated GPU.

The gate (the worker's own check before the copy) sees enough free memory; then another
tenant takes the room (fault ``tenant_on_copy``: this test process, a live pid, takes the bytes
right before the copy) and the copy runs out, as a CUDA OOM would. The worker must go back to
sleep with nothing left on the device, answer a not-ok ACK that says how much more it needed,
and wake normally from its host copy once the tenant has gone.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from omnistage.worker.v1 import types_pb2
from tests.cluster.test_fakegpu_worker import Worker
from tests.fakegpu.device import FakeGpu
from tests.fakegpu.model import Device, MiB
from tests.worker.tiny_models import build_causal_lm

pytestmark = [pytest.mark.timeout(300)]


@pytest.fixture
def workers() -> Iterator[list[Worker]]:
    started: list[Worker] = []
    yield started
    for w in started:
        w.stop()


def test_a_wake_out_of_memory_mid_copy_goes_back_to_sleep_and_says_what_it_needed(
    tmp_path: Path, workers: list[Worker]
) -> None:
    model = build_causal_lm(tmp_path / "lm")
    device = Device(uuid="GPU-fake-oom", total=16 * MiB, activation=0)
    gpu = FakeGpu.create(tmp_path / "gpu", device)
    worker = Worker(model, gpu.dir, tmp_path / "w.log")
    workers.append(worker)
    worker.loaded(types_pb2.WORKER_STATE_ACTIVE)
    awake = worker.status()
    on_device = awake.used_bytes - device.context  # the engine's flat buffer
    assert on_device > 0
    first = worker.generate().text.token_ids
    assert worker.sleep().ok
    asleep = worker.status()
    assert asleep.used_bytes == device.context

    # The tenant leaves half the weights' room: enough at the gate, not at the copy.
    tenant = asleep.free_bytes - on_device // 2
    me = os.getpid()
    gpu.set_faults(pid=worker.pid, tenant_on_copy=[me, tenant])
    ack = worker.wake()
    assert not ack.ok
    assert "out of memory" in ack.error.lower() and "needed" in ack.error
    assert ack.state == types_pb2.WORKER_STATE_ASLEEP
    assert ack.level == types_pb2.SLEEP_LEVEL_OFFLOAD
    # nothing of the wake is left on the device: the worker holds its context only
    assert ack.used_after_bytes == device.context
    assert gpu.snapshot().procs[worker.pid].charged == device.context
    assert ack.free_after_bytes == asleep.free_bytes - tenant
    assert ack.needed_bytes == on_device - ack.free_after_bytes > 0
    status = worker.status()
    assert status.state == types_pb2.WORKER_STATE_ASLEEP and not status.error

    # The tenant goes; the weights were still in host memory: the next wake copies them back.
    gpu.withdraw(me)
    woke = worker.wake()
    assert woke.ok and woke.needed_bytes == 0, woke.error
    assert woke.used_after_bytes == awake.used_bytes
    assert worker.generate().text.token_ids == first
