"""The operator's channels to workers follow each stage's pod: the channel to a replaced pod
and to a deleted stage is closed, so channels open stay bounded by the stages however many
pods were replaced (counted by the operator's own registry, ``GroupRunner.channels``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from omnistage.worker.v1 import sleep_service_pb2, sleep_service_pb2_grpc, types_pb2
from omnistage_operator.api.spec_parse import parse_stage
from omnistage_operator.decisions.handover import WorkerUnavailable
from omnistage_operator.k8s.settings import Settings
from omnistage_operator.k8s.worker_client import WorkerClient
from omnistage_operator.runtime.runner import GroupRunner
from tests.unit.sleep_fakes import SleepServiceWithoutOverlap

ADDRESSES = [f"127.0.0.{i}" for i in range(2, 12)]  # every replacement pod gets another IP


class _Asleep(SleepServiceWithoutOverlap):
    """A worker asleep that takes no orders (only GetStatus is called here)."""

    async def Sleep(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not here")

    async def WakeUp(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not here")

    async def GetStatus(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return sleep_service_pb2.GetStatusResponse(state=types_pb2.WORKER_STATE_ASLEEP)


@pytest.fixture
async def port() -> AsyncIterator[int]:
    """One worker port answered on every address of ``ADDRESSES``."""
    server = grpc.aio.server()
    sleep_service_pb2_grpc.add_SleepServiceServicer_to_server(_Asleep(), server)
    number = server.add_insecure_port(f"{ADDRESSES[0]}:0")
    for address in ADDRESSES[1:]:
        server.add_insecure_port(f"{address}:{number}")
    await server.start()
    try:
        yield number
    finally:
        await server.stop(None)


class _Leading:
    epoch = 1

    def leading(self) -> bool:
        return True


def _spec(name: str, port: int) -> Any:
    return parse_stage({
        "metadata": {"name": name, "namespace": "ns", "uid": f"s-{name}", "generation": 1},
        "spec": {
            "runner": "AR", "backend": "Transformers", "image": "img",
            "model": {"path": "/models/m"}, "colocation": {"group": "g"},
            "worker": {"port": port},
        },
    })  # fmt: skip


def _pod(uid: str, ip: str) -> dict[str, Any]:
    return {"metadata": {"name": "w", "uid": uid}, "status": {"podIP": ip, "phase": "Running"}}


async def _until(what: str, ok: Any, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while not ok():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def test_channels_stay_bounded_over_pod_replacements_and_close_with_the_stage(
    port: int,
) -> None:
    runner = GroupRunner(None, Settings(), _Leading())  # type: ignore[arg-type]
    specs = [_spec("a", port), _spec("b", port)]
    used: list[WorkerClient] = []
    try:
        for n, ip in enumerate(ADDRESSES * 2):  # 20 pods per stage, one after the other
            for spec in specs:
                client = runner.client_for("ns", spec, _pod(f"{spec.name}-{n}", ip))
                assert client is not None
                assert runner.client_for("ns", spec, _pod(f"{spec.name}-{n}", ip)) is client
                await client.get_status(5.0)  # connected
                used.append(client)
            assert len(runner.channels) <= 2 * len(specs)  # the open ones and the closing ones
        await _until("replaced pods' channels closed", lambda: len(runner.channels) == 2)
        old, current = used[:-2], used[-2:]
        assert all(c.closed for c in old) and not any(c.closed for c in current)
        with pytest.raises((WorkerUnavailable, grpc.aio.UsageError)):
            await old[-1].get_status(1.0)
        runner.forget("ns", "a")  # stage a deleted
        await _until("deleted stage's channel closed", lambda: len(runner.channels) == 1)
        assert current[0].closed and not current[1].closed
    finally:
        await runner.close()
    assert len(runner.channels) == 0 and all(c.closed for c in used)


async def test_the_same_pod_at_another_address_gets_a_new_channel(port: int) -> None:
    runner = GroupRunner(None, Settings(), _Leading())  # type: ignore[arg-type]
    spec = _spec("a", port)
    try:
        first = runner.client_for("ns", spec, _pod("p", ADDRESSES[0]))
        moved = runner.client_for("ns", spec, _pod("p", ADDRESSES[1]))
        assert first is not None and moved is not None and moved is not first
        await _until("old address's channel closed", lambda: first.closed)
        assert runner.client_for("ns", spec, _pod("p", "")) is None  # no address: no channel
        assert runner.client_for("ns", spec, _pod("p", ADDRESSES[1])) is moved
    finally:
        await runner.close()
