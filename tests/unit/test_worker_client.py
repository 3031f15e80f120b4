"""The operator's worker client and port against an in-process gRPC SleepService.

The fake service records every request it receives and answers as told (an Ack, or an abort with
a status code), so the tests see what the operator really puts on the wire: the leadership
epoch, the drain timeout, the deadline, and how each refusal is classified.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Hashable
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest

from omnistage.worker.v1 import sleep_service_pb2, sleep_service_pb2_grpc, types_pb2
from omnistage_operator.api.spec_parse import parse_stage
from omnistage_operator.decisions.handover import (
    WorkerRefused,
    WorkerUnauthenticated,
    WorkerUnavailable,
)
from omnistage_operator.decisions.leadership import LeadershipLost
from omnistage_operator.k8s.port import KubeGroupPort
from omnistage_operator.k8s.settings import Settings
from omnistage_operator.k8s.views import GroupViews
from omnistage_operator.k8s.worker_client import WorkerClient
from omnistage_operator.runtime.runner import GroupRunner
from tests.unit.sleep_fakes import SleepServiceWithoutOverlap


@dataclass
class FakeService(SleepServiceWithoutOverlap):
    """Records requests; ``abort`` (code, message) makes every call fail with that status."""

    requests: list[tuple[str, Any, float | None]] = field(default_factory=list)
    abort: tuple[grpc.StatusCode, str] | None = None
    delay_s: float = 0.0

    async def _answer(self, op: str, request: Any, context: grpc.aio.ServicerContext) -> Any:
        self.requests.append((op, request, context.time_remaining()))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.abort is not None:
            await context.abort(*self.abort)
        operation = types_pb2.OPERATION_SLEEP if op == "sleep" else types_pb2.OPERATION_WAKE_UP
        return types_pb2.Ack(
            task_id=request.task_id, ok=True, operation=operation, epoch=request.epoch
        )

    async def Sleep(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return sleep_service_pb2.SleepResponse(ack=await self._answer("sleep", request, context))

    async def WakeUp(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return sleep_service_pb2.WakeUpResponse(ack=await self._answer("wake", request, context))

    async def GetStatus(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return sleep_service_pb2.GetStatusResponse(state=types_pb2.WORKER_STATE_ASLEEP)


@pytest.fixture
async def served() -> AsyncIterator[tuple[FakeService, str]]:
    service = FakeService()
    server = grpc.aio.server()
    sleep_service_pb2_grpc.add_SleepServiceServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield service, f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


async def test_sleep_and_wake_carry_the_leadership_epoch(
    served: tuple[FakeService, str],
) -> None:
    service, target = served
    client = WorkerClient(target)
    try:
        ack = await client.sleep(1, "t-sleep", 5.0, epoch=7)
        assert ack.ok
        await client.wake("t-wake", 5.0, epoch=7)
    finally:
        await client.close()
    assert [(op, req.epoch) for op, req, _ in service.requests] == [("sleep", 7), ("wake", 7)]


class _Leadership:
    def __init__(self, leading: bool, epoch: int = 3) -> None:
        self.epoch = epoch
        self.is_leading = leading

    def leading(self) -> bool:
        return self.is_leading


class _NoKube:
    """Any API call fails the test: a non-leading operator must not even read."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the API was called ({name}) by a non-leading operator")


def _stage_body(port: int) -> dict[str, Any]:
    return {
        "metadata": {"name": "ar", "namespace": "ns", "uid": "u1", "generation": 1},
        "spec": {
            "runner": "AR",
            "backend": "Transformers",
            "image": "img",
            "model": {"path": "/models/m"},
            "colocation": {"group": "g"},
            "worker": {"port": port},
        },
    }


async def test_no_round_while_not_leading() -> None:
    runner = GroupRunner(_NoKube(), Settings(), _Leadership(False))  # type: ignore[arg-type]
    assert await runner.round("ns", "g") is False


async def test_port_refuses_to_order_once_leadership_is_lost(
    served: tuple[FakeService, str],
) -> None:
    service, target = served
    leadership = _Leadership(True, epoch=4)
    runner = GroupRunner(_NoKube(), Settings(), leadership)  # type: ignore[arg-type]
    port = KubeGroupPort(runner, "ns", "g")
    body = _stage_body(int(target.rsplit(":", 1)[1]))
    port.specs["ar"] = parse_stage(body)
    port.bodies["ar"] = body
    port.pods["ar"] = {
        "metadata": {"name": "ar-worker", "uid": "p1"},
        "status": {"podIP": "127.0.0.1"},
    }
    try:
        await port.sleep("ar", 1, "t1")
        leadership.is_leading = False
        with pytest.raises(LeadershipLost):
            await port.sleep("ar", 1, "t2")
        with pytest.raises(LeadershipLost):
            await port.wake("ar", "t3")
        with pytest.raises(LeadershipLost):
            await port.fence("ar", "test")
    finally:
        await runner.close()
    assert [(op, req.task_id, req.epoch) for op, req, _ in service.requests] == [("sleep", "t1", 4)]


@pytest.mark.parametrize(
    "code",
    [
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.PERMISSION_DENIED,
    ],
)
async def test_deliberate_answers_are_refusals_with_the_workers_words(
    served: tuple[FakeService, str], code: grpc.StatusCode
) -> None:
    service, target = served
    service.abort = (code, "worker failed: model directory /m does not exist")
    client = WorkerClient(target)
    try:
        with pytest.raises(WorkerRefused) as info:
            await client.wake("t", 5.0)
    finally:
        await client.close()
    assert info.value.code == code.name
    assert info.value.message == "worker failed: model directory /m does not exist"
    assert not isinstance(info.value, WorkerUnavailable)


async def test_silence_is_unavailable_and_a_bad_token_unauthenticated(
    served: tuple[FakeService, str],
) -> None:
    service, target = served
    client = WorkerClient(target)
    try:
        service.delay_s = 1.0
        with pytest.raises(WorkerUnavailable, match="DEADLINE_EXCEEDED"):
            await client.sleep(1, "slow", 0.2)
        service.delay_s = 0.0
        service.abort = (grpc.StatusCode.UNAVAILABLE, "going away")
        with pytest.raises(WorkerUnavailable, match="UNAVAILABLE"):
            await client.sleep(1, "gone", 5.0)
        service.abort = (grpc.StatusCode.UNAUTHENTICATED, "bad token")
        with pytest.raises(WorkerUnauthenticated):
            await client.sleep(1, "tok", 5.0)
    finally:
        await client.close()


async def test_sleep_carries_the_drain_timeout_and_the_port_waits_drain_plus_sleep_timeout(
    served: tuple[FakeService, str],
) -> None:
    service, target = served
    runner = GroupRunner(_NoKube(), Settings(sleep_timeout_s=7.0))  # type: ignore[arg-type]
    port = KubeGroupPort(runner, "ns", "g")
    body = _stage_body(int(target.rsplit(":", 1)[1]))
    body["spec"]["drainTimeoutSeconds"] = 45
    port.specs["ar"] = parse_stage(body)
    port.bodies["ar"] = body
    port.pods["ar"] = {
        "metadata": {"name": "ar-worker", "uid": "p1"},
        "status": {"podIP": "127.0.0.1"},
    }
    try:
        await port.sleep("ar", 1, "t1", drain_timeout_s=45.0)  # no deadline given: 45 + 7
        await port.sleep("ar", 1, "t2", drain_timeout_s=45.0, timeout_s=3.0)
    finally:
        await runner.close()
    (_, first, left1), (_, second, left2) = service.requests
    assert first.drain_timeout.ToTimedelta().total_seconds() == 45.0
    assert second.drain_timeout.ToTimedelta().total_seconds() == 45.0
    assert left1 is not None and 50.0 < left1 <= 52.5
    assert left2 is not None and left2 <= 3.5


async def test_a_group_gets_one_resync_round_per_interval_whatever_its_stage_count() -> None:
    # each group has a stage (a group with none is forgotten when its loop ends)
    stages: dict[Hashable, list[dict[str, Any]]] = {
        ("group", "ns", g): [{"metadata": {"name": f"{g}-a"}}] for g in ("g", "h")
    }
    views = GroupViews(stages, {})
    runner = GroupRunner(_NoKube(), Settings(), _Leadership(False), views)  # type: ignore[arg-type]
    rounds: list[str] = []

    async def counted(namespace: str, group: str) -> bool:
        rounds.append(group)
        return False

    runner.round = counted  # type: ignore[method-assign]

    async def settled() -> None:
        for loop in runner._loops.values():
            if loop.task is not None:
                await loop.task

    runner.resync("ns", "g", 10.0)  # never had a round: one now
    await settled()
    runner.resync("ns", "g", 10.0)  # its other stage's timer, right after: nothing
    runner.resync("ns", "h", 10.0)
    await settled()
    assert rounds == ["g", "h"]
    runner._loops[("ns", "g")].last_round -= 9.5  # most of an interval later: due again
    runner.resync("ns", "g", 10.0)
    await settled()
    assert rounds == ["g", "h", "g"]
