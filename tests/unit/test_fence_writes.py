"""The status writes of a fence in a round (``KubeGroupPort.fence``, then the round's checkpoint).

A fence is recorded in ``status.fencePending`` before its delete (a restarted operator keeps the
gate closed until the API confirms the pod gone). Once confirmed, the clearance is not a write
of its own: the round's checkpoint (or publish) writes the stage's status right after, and
carries ``fencePending: null`` with the fence's outcome.
"""

from __future__ import annotations

from typing import Any

from omnistage_operator.api.spec_parse import parse_stage
from omnistage_operator.decisions.arbiter import BlockReason, FenceOrder, StageFacts, WorkerPhase
from omnistage_operator.decisions.handover import FenceResult, RoundOutcome
from omnistage_operator.k8s.port import KubeGroupPort
from omnistage_operator.k8s.settings import Settings
from omnistage_operator.runtime.runner import GroupRunner
from tests.unit.test_publish_order import _body


class Api:
    """Status patches noted; a delete confirmed at once; Events accepted."""

    def __init__(self) -> None:
        self.patches: list[tuple[str, dict[str, Any]]] = []

    async def merge_patch(
        self, kind: Any, namespace: str, name: str, patch: Any, *, status: bool = False,
        answer: bool = True,
    ) -> Any:  # fmt: skip
        assert status
        self.patches.append((name, dict(patch["status"])))
        return {}

    async def delete_confirmed(self, *_: Any, **__: Any) -> bool:
        return True

    async def event(self, *_: Any, **__: Any) -> None:
        return None


async def test_a_confirmed_fence_is_cleared_by_the_checkpoint_not_by_a_write_of_its_own() -> None:
    api = Api()
    runner = GroupRunner(api, Settings())  # type: ignore[arg-type]
    port = KubeGroupPort(runner, "ns", "g")
    body = {**_body("a", "Asleep"), "status": {"state": "Active"}}
    port.specs["a"], port.bodies["a"] = parse_stage(body), body
    port.pods["a"] = {"metadata": {"name": "a-worker", "uid": "p-a"}, "status": {}}

    await port.fence("a", "sleep h1 failed")
    assert api.patches == [("a", {"fencePending": "sleep h1 failed"})]  # before the delete
    assert ("ns", "a") not in runner.fence_pending  # confirmed: the gate knows at once

    port.facts["a"] = StageFacts(WorkerPhase.ABSENT)
    order = FenceOrder("a", BlockReason.UNREACHABLE, "a does not answer")
    await port.checkpoint(RoundOutcome(fences=[FenceResult(order, True)]))
    await port.checkpoint_written()  # issued by the checkpoint, answered by the round's end
    assert len(api.patches) == 2
    name, status = api.patches[1]
    assert name == "a" and "fencePending" in status and status["fencePending"] is None
