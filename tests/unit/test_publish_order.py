"""A publish writes the status that changes a stage's state first, the others' after.

After a wake, the woken stage's status turns Active while the stage that slept only gets new
figures (the device's free memory): the first is what a user (``kubectl get -w``) waits for, so
it does not share the API server with the second, nor wait for the checkpoint's write of the
stage that slept (a later write of that stage does).
"""

from __future__ import annotations

import asyncio
from typing import Any

from omnistage_operator.api.spec_parse import parse_stage
from omnistage_operator.decisions.arbiter import SleepOrder, StageFacts, WorkerPhase
from omnistage_operator.decisions.facts import AckFacts
from omnistage_operator.decisions.handover import RoundOutcome, SleepResult
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


def _port(runner: GroupRunner, *stages: tuple[str, str, WorkerPhase]) -> KubeGroupPort:
    """A port of group ``g`` whose stages (name, spec.state, the worker's phase) are read."""
    port = KubeGroupPort(runner, "ns", "g")
    for name, state, phase in stages:
        body = _body(name, state)
        port.specs[name] = parse_stage(body)
        port.bodies[name] = body
        port.facts[name] = StageFacts(phase)
    return port


async def test_the_new_state_is_written_before_the_new_figures() -> None:
    kube = SlowPatches()
    runner = GroupRunner(kube, Settings())  # type: ignore[arg-type]
    port = _port(runner, ("b", "Asleep", WorkerPhase.ASLEEP), ("a", "Active", WorkerPhase.ACTIVE))
    runner.published[("ns", "a")] = {"state": "Asleep"}  # woken: its state changes
    runner.published[("ns", "b")] = {"state": "Asleep", "devices": []}  # figures only
    await runner.publish(port, RoundOutcome(), events=False)
    assert kube.log == [("begin", "a"), ("end", "a"), ("begin", "b"), ("end", "b")]


class HeldPatches(SlowPatches):
    """``SlowPatches`` whose first write of ``held`` waits until ``release`` is set."""

    def __init__(self, held: str) -> None:
        super().__init__()
        self.held = held
        self.release = asyncio.Event()

    async def merge_patch(self, kind: Any, namespace: str, name: str, patch: Any, **_: Any) -> Any:
        if name == self.held and not self.release.is_set():
            self.log.append(("begin", name))
            await self.release.wait()
            self.log.append(("end", name))
            return {}
        return await super().merge_patch(kind, namespace, name, patch)


async def test_the_woken_stage_is_written_without_waiting_for_the_checkpoint() -> None:
    """Under load each write waits for a request slot: the woken stage's Active does not queue
    behind the checkpoint's write of the stage that slept, which still lands before that
    stage's next write."""
    kube = HeldPatches("b")
    runner = GroupRunner(kube, Settings())  # type: ignore[arg-type]
    port = _port(runner, ("a", "Active", WorkerPhase.ASLEEP), ("b", "Asleep", WorkerPhase.ASLEEP))
    runner.published[("ns", "a")] = {"state": "Asleep"}
    runner.published[("ns", "b")] = {"state": "Active"}
    ack = AckFacts("h1-b-sleep1", True, "sleep", WorkerPhase.ASLEEP, level=1)
    slept = RoundOutcome(sleeps=[SleepResult(SleepOrder("b", 1), "h1-b-sleep1", ack, 1)])
    await asyncio.wait_for(port.checkpoint(slept), 1)  # issued, not answered
    port.facts["a"] = StageFacts(WorkerPhase.ACTIVE)  # woken
    runner.published[("ns", "b")] = {"state": "Asleep", "devices": []}  # b: new figures
    publish = asyncio.create_task(runner.publish(port, RoundOutcome(), events=False))
    for _ in range(100):
        if ("end", "a") in kube.log:
            break
        await asyncio.sleep(0.01)
    assert kube.log == [("begin", "b"), ("begin", "a"), ("end", "a")]
    kube.release.set()
    await asyncio.wait_for(publish, 1)
    await port.checkpoint_written()
    assert kube.log[3:] == [("end", "b"), ("begin", "b"), ("end", "b")]
