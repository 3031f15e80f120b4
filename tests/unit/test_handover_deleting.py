"""A stage being deleted gets no pod from a round: the port says so (``StageDeleting``) and the
round records neither a started stage (no PodCreated Event, no status of a started stage) nor
an error. Seen on the local control plane: a round in flight when a stage was deleted posted
"worker pod created asleep" for a pod never made."""

from __future__ import annotations

from omnistage_operator.decisions.arbiter import GroupMemory, StageFacts, StageIntent, WorkerPhase
from omnistage_operator.decisions.facts import AckFacts
from omnistage_operator.decisions.handover import (
    GroupObservation,
    RoundOutcome,
    RoundPolicy,
    StageDeleting,
)
from omnistage_operator.decisions.handover.rounds import run_round


class DeletingPort:
    """Stage "a" has no pod and is being deleted; "b" has none and is not."""

    def __init__(self) -> None:
        self.created: list[str] = []

    async def observe(self) -> GroupObservation:
        intents = {"a": StageIntent("a", False), "b": StageIntent("b", False)}
        facts = {n: StageFacts(WorkerPhase.ABSENT) for n in intents if n not in self.created}
        facts.update({n: StageFacts(WorkerPhase.ASLEEP, level=1) for n in self.created})
        return GroupObservation(intents, facts, GroupMemory(16, 16))

    async def start(self, stage: str) -> None:
        if stage == "a":
            raise StageDeleting(stage)
        self.created.append(stage)

    async def probe(self, stage: str) -> StageFacts:
        return (await self.observe()).facts[stage]

    async def sleep(self, stage: str, level: int, task_id: str, **_: object) -> AckFacts:
        raise AssertionError("nothing is awake")

    async def wake(self, stage: str, task_id: str) -> AckFacts:
        raise AssertionError("nothing wants memory")

    async def fence(self, stage: str, reason: str) -> None:
        raise AssertionError("nothing to fence")

    async def checkpoint(self, outcome: RoundOutcome) -> None:
        return None


async def test_a_stage_being_deleted_is_neither_started_nor_an_error() -> None:
    port = DeletingPort()
    out = await run_round(port, RoundPolicy(), lambda: "r1")
    assert out.started == ["b"]  # the other stage starts as before
    assert "a" not in out.stage_errors
