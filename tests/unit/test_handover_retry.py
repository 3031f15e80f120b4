"""Sleep retries: same task id, backoff, the retry window, then the fence."""

from __future__ import annotations

import time

from omnistage_operator.decisions.arbiter import GroupMemory, StageFacts, StageIntent, WorkerPhase
from omnistage_operator.decisions.facts import AckFacts
from omnistage_operator.decisions.handover import (
    GroupObservation,
    RoundOutcome,
    RoundPolicy,
    WorkerUnavailable,
)
from omnistage_operator.decisions.handover.rounds import run_round


class StartingWorkerPort:
    """Stage "a" holds memory and refuses connections for ``refuse_s``; "b" wants it."""

    def __init__(self, refuse_s: float) -> None:
        self.began = time.monotonic()
        self.refuse_s = refuse_s
        self.a = WorkerPhase.ACTIVE
        self.b = WorkerPhase.ASLEEP
        self.task_ids: list[str] = []
        self.fenced = False

    async def observe(self) -> GroupObservation:
        intents = {"a": StageIntent("a", False), "b": StageIntent("b", True, vram_request=10)}
        a = StageFacts(WorkerPhase.ABSENT if self.fenced else self.a, used_bytes=10)
        used = 10 if a.phase is WorkerPhase.ACTIVE else 0
        facts = {"a": a, "b": StageFacts(self.b, level=1)}
        return GroupObservation(intents, facts, GroupMemory(16, 16 - used))

    async def start(self, stage: str) -> None:
        raise AssertionError("no pod is created here")

    async def probe(self, stage: str) -> StageFacts:
        return (await self.observe()).facts[stage]

    async def sleep(
        self,
        stage: str,
        level: int,
        task_id: str,
        *,
        drain_timeout_s: float | None = None,
        timeout_s: float | None = None,
        components: tuple[str, ...] = (),
    ) -> AckFacts:
        self.task_ids.append(task_id)
        if time.monotonic() - self.began < self.refuse_s:
            raise WorkerUnavailable("connection refused")
        self.a = WorkerPhase.ASLEEP
        return AckFacts(task_id, True, "sleep", WorkerPhase.ASLEEP, level=level)

    async def wake(self, stage: str, task_id: str) -> AckFacts:
        assert self.a is WorkerPhase.ASLEEP or self.fenced
        self.b = WorkerPhase.ACTIVE
        return AckFacts(task_id, True, "wake", WorkerPhase.ACTIVE)

    async def fence(self, stage: str, reason: str) -> None:
        self.fenced = True

    async def checkpoint(self, outcome: RoundOutcome) -> None:
        return None


async def test_refusing_worker_is_retried_within_the_window_with_one_task_id() -> None:
    port = StartingWorkerPort(refuse_s=0.3)
    policy = RoundPolicy(ack_retries=1, backoff_s=0.05, retry_window_s=2.0)
    out = await run_round(port, policy, lambda: "h1")
    assert not port.fenced
    assert len(port.task_ids) > 1 and set(port.task_ids) == {"h1-a-sleep1"}
    assert out.sleeps[0].ok and list(out.wakes) == ["b"]


async def test_without_a_window_the_retries_end_in_a_fence() -> None:
    port = StartingWorkerPort(refuse_s=60)
    policy = RoundPolicy(ack_retries=2, backoff_s=0.01, retry_window_s=0.0)
    out = await run_round(port, policy, lambda: "h1")
    assert port.fenced and len(port.task_ids) == 2
    assert out.sleeps[0].fenced and list(out.wakes) == ["b"]
