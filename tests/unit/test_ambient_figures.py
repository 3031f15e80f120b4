"""A stage whose status changed only in the devices' free memory is not written again at once.

After a hand-over's wake, the stage that slept (written by the checkpoint) saw only the device's
free memory fall: that figure waits for its next write, or for a round ``REFRESH_S`` after the
last one, instead of a second status write of the sleeper per hand-over.
"""

from __future__ import annotations

from typing import Any

from omnistage_operator.api.spec_parse import parse_stage
from omnistage_operator.decisions.ambient import REFRESH_S, deferred
from omnistage_operator.decisions.arbiter import StageFacts, WorkerPhase
from omnistage_operator.decisions.facts import DeviceFigures, WorkerReport
from omnistage_operator.decisions.handover import RoundOutcome
from omnistage_operator.k8s.port import KubeGroupPort
from omnistage_operator.k8s.settings import Settings
from omnistage_operator.runtime.runner import GroupRunner

GiB = 1024**3


class Patches:
    """Status patches, answered at once, in order."""

    def __init__(self) -> None:
        self.written: list[tuple[str, dict[str, Any]]] = []

    async def merge_patch(self, kind: Any, namespace: str, name: str, patch: Any, **_: Any) -> Any:
        self.written.append((name, patch["status"]))
        return {}


def _port(runner: GroupRunner, free: int, phase: WorkerPhase = WorkerPhase.ASLEEP) -> KubeGroupPort:
    """Group ``g`` with one stage ``b`` (spec Asleep) whose worker reports ``free`` bytes free."""
    port = KubeGroupPort(runner, "ns", "g")
    body = {
        "metadata": {"name": "b", "namespace": "ns", "uid": "u-b", "generation": 1},
        "spec": {
            "runner": "AR", "backend": "Transformers", "image": "img",
            "model": {"path": "/models/m"}, "colocation": {"group": "g"}, "state": "Asleep",
        },
    }  # fmt: skip
    port.specs["b"] = parse_stage(body)
    port.bodies["b"] = body
    port.facts["b"] = StageFacts(phase)
    device = DeviceFigures(uuid="GPU-0", total=80 * GiB, used_after=GiB, free_after=free)
    port.reports["b"] = WorkerReport(
        phase, level=1, used_bytes=GiB, free_bytes=free, total_bytes=80 * GiB, devices=(device,)
    )
    return port


async def test_only_the_free_memory_moved_no_write_until_the_refresh() -> None:
    kube = Patches()
    runner = GroupRunner(kube, Settings())  # type: ignore[arg-type]
    await runner.publish(_port(runner, 79 * GiB), RoundOutcome(), events=False)
    assert [n for n, _ in kube.written] == ["b"]
    # the other stage woke: the device's free memory fell, nothing else of b changed
    await runner.publish(_port(runner, 29 * GiB), RoundOutcome(), events=False)
    assert len(kube.written) == 1
    runner.written_at[("ns", "b")] -= REFRESH_S  # the last write is old: the figures go out
    await runner.publish(_port(runner, 29 * GiB), RoundOutcome(), events=False)
    assert len(kube.written) == 2
    assert kube.written[1][1]["devices"][0]["freeBytes"] == 29 * GiB
    assert kube.written[1][1]["memory"]["freeBytes"] == 29 * GiB


async def test_a_change_beside_the_free_memory_is_written_with_it() -> None:
    kube = Patches()
    runner = GroupRunner(kube, Settings())  # type: ignore[arg-type]
    await runner.publish(_port(runner, 79 * GiB), RoundOutcome(), events=False)
    await runner.publish(_port(runner, 29 * GiB, WorkerPhase.ACTIVE), RoundOutcome(), events=False)
    assert [s["state"] for _, s in kube.written] == ["Asleep", "Active"]
    assert kube.written[1][1]["devices"][0]["freeBytes"] == 29 * GiB


def test_deferred_only_for_the_free_figures_of_a_recent_write() -> None:
    written = {
        "state": "Asleep",
        "memory": {"usedBytes": 1, "freeBytes": 10},
        "devices": [{"usedBytes": 1, "freeBytes": 10, "free": "10 B"}],
    }
    moved = {
        "state": "Asleep",
        "memory": {"usedBytes": 1, "freeBytes": 5},
        "devices": [{"usedBytes": 1, "freeBytes": 5, "free": "5 B"}],
    }
    assert deferred(written, moved, 1.0)
    assert not deferred(written, moved, REFRESH_S)  # stale: written now
    assert not deferred(written, written, 1.0)  # unchanged: nothing to defer
    assert not deferred(None, moved, 1.0)  # never written
    used = {**moved, "memory": {"usedBytes": 2, "freeBytes": 5}}
    assert not deferred(written, used, 1.0)  # its own use moved
    assert not deferred(written, {**moved, "state": "Active"}, 1.0)
