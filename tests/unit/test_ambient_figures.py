"""A stage whose status changed only in the devices' free memory is not written again at once.

After a hand-over's wake, the stage that slept (written by the checkpoint) saw only the device's
free memory fall: that figure waits for its next write, or for a round ``REFRESH_S`` after the
last one, instead of a second status write of the sleeper per hand-over.
"""

from __future__ import annotations

from typing import Any

from omnistage_operator.api.spec_parse import parse_stage
from omnistage_operator.decisions.ambient import REFRESH_S, deferred, shown_free
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


def _two_stage_port(runner: GroupRunner, free: int) -> KubeGroupPort:
    """``_port``'s group with a second stage ``a`` on the same device (spec Asleep, asleep)."""
    port = _port(runner, free)
    body = {**port.bodies["b"], "metadata": {**port.bodies["b"]["metadata"], "name": "a"}}
    body["metadata"]["uid"] = "u-a"
    port.specs["a"] = parse_stage(body)
    port.bodies["a"] = body
    port.facts["a"] = port.facts["b"]
    port.reports["a"] = port.reports["b"]
    return port


def _a_active(runner: GroupRunner, free: int) -> KubeGroupPort:
    """``_two_stage_port`` with ``a`` Active (50 GiB used) and the device at ``free``."""
    port = _two_stage_port(runner, free)
    port.facts["a"] = StageFacts(WorkerPhase.ACTIVE)
    port.reports["a"] = WorkerReport(
        WorkerPhase.ACTIVE, level=None, used_bytes=50 * GiB, free_bytes=free,
        total_bytes=80 * GiB, devices=port.reports["b"].devices,
    )  # fmt: skip
    return port


async def test_the_refresh_is_not_written_when_another_stage_shows_the_figure() -> None:
    """A storm longer than ``REFRESH_S`` wrote every sleeper once more for the free memory the
    stage that woke on its device was written with (1000 groups on two cores)."""
    kube = Patches()
    runner = GroupRunner(kube, Settings())  # type: ignore[arg-type]
    await runner.publish(_two_stage_port(runner, 79 * GiB), RoundOutcome(), events=False)
    assert sorted(n for n, _ in kube.written) == ["a", "b"]
    runner.written_at[("ns", "b")] -= REFRESH_S  # b's write is old
    # a is written for a change of its own, with the device's new free memory
    await runner.publish(_a_active(runner, 29 * GiB), RoundOutcome(), events=False)
    assert [n for n, _ in kube.written[2:]] == ["a"]  # b's free figure is a's: not written
    assert kube.written[2][1]["devices"][0]["freeBytes"] == 29 * GiB
    # a figure no other stage shows is written, as before
    runner.written_at[("ns", "b")] -= REFRESH_S
    port = _a_active(runner, 28 * GiB)
    runner.written_at[("ns", "a")] -= 1  # a's own change of free alone: deferred (recent)
    await runner.publish(port, RoundOutcome(), events=False)
    assert [n for n, _ in kube.written[3:]] == ["b"]


def test_shown_free_is_each_devices_latest_written_figure() -> None:
    older = {"devices": [{"uuid": "GPU-0", "freeBytes": 10}, {"uuid": "GPU-1", "freeBytes": 7}]}
    newer = {"devices": [{"uuid": "GPU-0", "freeBytes": 5}]}
    assert shown_free([(2.0, newer), (1.0, older), (3.0, None)]) == {"GPU-0": 5, "GPU-1": 7}
    status = {"state": "Asleep", "devices": [{"uuid": "GPU-0", "freeBytes": 5, "free": "5 B"}]}
    written = {"state": "Asleep", "devices": [{"uuid": "GPU-0", "freeBytes": 9, "free": "9 B"}]}
    assert deferred(written, status, REFRESH_S, {"GPU-0": 5})
    assert not deferred(written, status, REFRESH_S, {"GPU-0": 6})  # not shown: the refresh
    assert not deferred(written, status, REFRESH_S, {})
    assert not deferred(written, {**status, "state": "Active"}, REFRESH_S, {"GPU-0": 5})
