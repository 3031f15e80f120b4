"""A publish writes the status that changes a stage's state first, the others' after.

After a wake, the woken stage's status turns Active while the stage that slept only gets new
figures (the device's free memory): the first is what a user (``kubectl get -w``) waits for, so
it does not share the API server with the second.
"""

from __future__ import annotations

import asyncio
from typing import Any

from omnistage_operator.api.spec_parse import parse_stage
from omnistage_operator.decisions.arbiter import StageFacts, WorkerPhase
from omnistage_operator.decisions.handover import RoundOutcome
from omnistage_operator.k8s.port import KubeGroupPort
from omnistage_operator.k8s.settings import Settings
from omnistage_operator.runtime.runner import GroupRunner


class SlowPatches:
    """Status patches answered after a moment; when each began and ended is noted."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str]] = []

    async def merge_patch(self, kind: Any, namespace: str, name: str, patch: Any, **_: Any) -> Any:
        self.log.append(("begin", name))
        await asyncio.sleep(0.02)
        self.log.append(("end", name))
        return {}


def _body(name: str, state: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "ns", "uid": f"u-{name}", "generation": 1},
        "spec": {
            "runner": "AR",
            "backend": "Transformers",
            "image": "img",
            "model": {"path": "/models/m"},
            "colocation": {"group": "g"},
            "state": state,
        },
    }


async def test_the_new_state_is_written_before_the_new_figures() -> None:
    kube = SlowPatches()
    runner = GroupRunner(kube, Settings())  # type: ignore[arg-type]
    port = KubeGroupPort(runner, "ns", "g")
    for name, state, phase in (
        ("b", "Asleep", WorkerPhase.ASLEEP),
        ("a", "Active", WorkerPhase.ACTIVE),
    ):
        body = _body(name, state)
        port.specs[name] = parse_stage(body)
        port.bodies[name] = body
        port.facts[name] = StageFacts(phase)
    runner.published[("ns", "a")] = {"state": "Asleep"}  # woken: its state changes
    runner.published[("ns", "b")] = {"state": "Asleep", "devices": []}  # figures only
    await runner.publish(port, RoundOutcome(), events=False)
    assert kube.log == [("begin", "a"), ("end", "a"), ("begin", "b"), ("end", "b")]
