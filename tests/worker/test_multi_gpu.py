"""A worker whose model spans two simulated GPUs: per-device Acks, status and residual checks.

The worker runs on CPU torch with ``--gpus 2``: its model is split over two devices by the
device map (one engine, one flat buffer, per device) and each device is a simulated GPU
(tests/fakegpu: its own capacity, context charge and faults) measured through the probe seam.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from omnistage.worker.v1 import types_pb2
from tests.fakegpu.device import FakeGpu
from tests.fakegpu.model import Device, GiB
from tests.worker.conftest import StartWorker, WorkerHandle

SLACK = 4096


@pytest.fixture
def gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[FakeGpu]:
    made = [
        FakeGpu.create(tmp_path / f"gpu{i}", Device(uuid=f"GPU-test-{i}", index=i, total=GiB))
        for i in range(2)
    ]
    monkeypatch.setenv("OMNISTAGE_MEMORY_PROBE", "tests.fakegpu.probe:from_env")
    monkeypatch.setenv("OMNISTAGE_FAKE_GPU", ",".join(str(g.dir) for g in made))
    return made


async def tokens(worker: WorkerHandle) -> list[int]:
    return list((await worker.generate(prompt="the cat sat", max_new_tokens=6)).text.token_ids)


def charged(gpu: FakeGpu) -> int:
    """What the simulated device charges all processes now (an outside observer's view)."""
    return gpu.snapshot().used_total


async def test_two_devices_sleep_and_wake_with_per_device_figures(
    start_worker: StartWorker, lm_dir: Path, gpus: list[FakeGpu]
) -> None:
    worker = await start_worker(lm_dir, "ar", "transformers", gpus=2, residual_slack=SLACK)
    status = await worker.status()
    assert [(d.device, d.uuid) for d in status.devices] == [
        ("cuda:0", "GPU-test-0"),
        ("cuda:1", "GPU-test-1"),
    ]
    for dev, gpu in zip(status.devices, gpus, strict=True):
        assert dev.used_after_bytes == charged(gpu) > gpu.device().context  # weights on both
    reference = await tokens(worker)

    for level in (1, 2):
        ack = await worker.sleep(level)
        assert ack.ok, ack.error
        assert [d.device for d in ack.devices] == ["cuda:0", "cuda:1"]
        for dev, gpu in zip(ack.devices, gpus, strict=True):
            assert dev.freed_bytes > 0  # each device gave its own weights back
            assert dev.used_after_bytes == charged(gpu)  # the device agrees: context only
            assert dev.free_after_bytes > dev.free_before_bytes
        assert ack.freed_bytes == sum(d.freed_bytes for d in ack.devices)
        woke = await worker.wake()
        assert woke.ok, woke.error
        for taken, gave, gpu in zip(woke.devices, ack.devices, gpus, strict=True):
            # each device takes its weights back (the sleep also gave the request's pool)
            assert 0 < -taken.freed_bytes < gave.freed_bytes
            assert taken.used_after_bytes == charged(gpu)
        assert await tokens(worker) == reference  # bit-identical after every wake


async def test_one_device_that_keeps_memory_makes_the_ack_not_ok(
    start_worker: StartWorker, lm_dir: Path, gpus: list[FakeGpu]
) -> None:
    worker = await start_worker(lm_dir, "ar", "transformers", gpus=2, residual_slack=SLACK)
    gpus[1].set_faults(leak_on_sleep="all")  # device 1 keeps what a sleep frees
    ack = await worker.sleep(1)
    assert not ack.ok
    assert ack.state == types_pb2.WORKER_STATE_FAILED
    assert ack.error.startswith("cuda:1: device memory still used after sleep")
    assert "cuda:0" not in ack.error
    first, second = ack.devices
    assert first.freed_bytes > 0 and second.freed_bytes == 0
    assert first.used_after_bytes == charged(gpus[0])
    assert second.used_after_bytes == charged(gpus[1])


async def test_a_diffusion_pipeline_split_over_two_devices_gives_the_same_image(
    start_worker: StartWorker, diffusion_dir: Path, gpus: list[FakeGpu]
) -> None:
    worker = await start_worker(diffusion_dir, "diffusion", "diffusers", gpus=2)
    request = {"prompt": "the cat", "num_inference_steps": 2, "height": 32, "width": 32}
    reference = (await worker.generate(**request)).image.png
    held = [charged(g) - g.device().context for g in gpus]
    assert all(h > 0 for h in held)  # whole components on each device
    ack = await worker.sleep(1)
    assert ack.ok, ack.error
    assert all(d.freed_bytes > 0 for d in ack.devices)
    woke = await worker.wake()
    assert woke.ok, woke.error
    assert (await worker.generate(**request)).image.png == reference
