"""The simulated worker host: real workers' gRPC and ACKs over the simulated GPU's physics.

Two workers of one host share one simulated device of room for one model: the figures each
reports follow the device (a context each, weights while awake, free memory shared), a wake
that would not fit is refused, a sleep frees what the worker held (the other can then wake),
an order of an older leadership epoch is refused, a stopped worker's memory is freed, and a
worker whose flags its own parser refuses exits 1 naming the reason.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from omnistage_operator.decisions.arbiter import WorkerPhase
from omnistage_operator.decisions.handover import WorkerRefused, WorkerUnavailable
from omnistage_operator.k8s.worker_client import WorkerClient
from tests.cluster.localnode.simlaunch import SimHostClient, SimWorker
from tests.fakegpu.device import FakeGpu
from tests.fakegpu.model import Device, MiB

pytestmark = [pytest.mark.timeout(120)]
TOKEN = "sim-token"
WEIGHTS = 600 * MiB


def _worker(model: Path, token: Path, ip: str, initial: str) -> list[str]:
    return [
        "/usr/bin/omnistage-worker",
        "--runner", "ar", "--backend", "transformers", "--model", str(model),
        f"--host={ip}", "--port", "50051", "--initial-state", initial, "--sleep-level", "1",
        "--token-file", str(token), "--device", "cpu", "--epoch", "3",
    ]  # fmt: skip


async def _ready(client: WorkerClient) -> WorkerPhase:
    for _ in range(400):
        try:
            report = await client.get_status(2.0)
        except WorkerUnavailable:
            await asyncio.sleep(0.05)
            continue
        if report.phase is not WorkerPhase.LOADING:
            return report.phase
        await asyncio.sleep(0.05)
    raise AssertionError("worker never left LOADING")


async def _scenario(tmp_path: Path) -> None:
    device = Device(uuid="GPU-sim-0", total=1024 * MiB, reserve=16 * MiB, context=64 * MiB)
    gpu_dir = tmp_path / "gpu-0"
    FakeGpu.create(gpu_dir, device)
    model = tmp_path / "model"
    model.mkdir()
    token = tmp_path / "token"
    token.write_text(TOKEN)
    env = {"OMNISTAGE_FAKE_GPU": str(gpu_dir), "OMNISTAGE_SIM_WEIGHTS": str(WEIGHTS)}
    host = SimHostClient(0, tmp_path / "sim.sock", tmp_path / "sim.log")
    await host.start()
    a_ip, b_ip = "127.77.0.2", "127.77.0.3"
    try:
        a = await host.launch("a", _worker(model, token, a_ip, "active"), env)
        b = await host.launch("b", _worker(model, token, b_ip, "asleep"), env)
        ca = WorkerClient(f"{a_ip}:50051", token=TOKEN)
        cb = WorkerClient(f"{b_ip}:50051", token=TOKEN)
        assert await _ready(ca) is WorkerPhase.ACTIVE
        assert await _ready(cb) is WorkerPhase.ASLEEP
        ra, rb = await ca.get_status(2.0), await cb.get_status(2.0)
        # a context each, a's weights, the driver reserve: everyone sees the same free memory
        assert ra.used_bytes == 64 * MiB + WEIGHTS
        assert rb.used_bytes == 64 * MiB
        assert ra.free_bytes == rb.free_bytes == device.total - 16 * MiB - 2 * 64 * MiB - WEIGHTS
        # its engine takes no memory piece by piece: no overlapped hand-over, and it says so
        assert not ra.claim_limits and not rb.claim_limits
        # b does not fit beside a: its wake is refused ahead, nothing charged
        ack = await cb.wake("w1", 5.0, epoch=3)
        assert not ack.ok and "free" in ack.error, ack
        assert (await cb.get_status(2.0)).used_bytes == 64 * MiB
        # an older leader's order is refused
        with pytest.raises(WorkerRefused, match="epoch"):
            await ca.sleep(1, "old", 5.0, epoch=2)
        ack = await ca.sleep(1, "s1", 5.0, epoch=3)
        assert ack.ok, ack
        assert (await ca.get_status(2.0)).used_bytes == 64 * MiB
        ack = await cb.wake("w2", 5.0, epoch=3)
        assert ack.ok, ack
        assert (await cb.get_status(2.0)).used_bytes == 64 * MiB + WEIGHTS
        # a stopped worker's memory is freed: b sees a's context gone
        await a.stop(2.0)
        assert a.returncode == 0
        free_after = (await cb.get_status(2.0)).free_bytes
        assert free_after == device.total - 16 * MiB - 64 * MiB - WEIGHTS
        await ca.close()
        await cb.close()
        bad = await host.launch("c", [*_worker(model, token, "127.77.0.4", "sideways")], env)
        assert isinstance(bad, SimWorker)
        assert await asyncio.wait_for(bad.wait(), 30) == 1
        assert "initial-state" in bad.message
        await b.stop(0)
        assert b.returncode == 137
    finally:
        await host.close()


def test_simulated_host_workers_follow_the_device(tmp_path: Path) -> None:
    asyncio.run(_scenario(tmp_path))
