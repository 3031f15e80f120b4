"""What the round's checkpoint writes on the Kubernetes side (``KubeGroupPort``).

Before its first wake a round writes the status of the stages its sleeps and fences concern
(their ACKs, the gate's evidence): issued before the wake, answered before the round ends. The
stage it wakes is written by the round's publish after the wake, not also before it: one status
write less on the hand-over's path. A wake that takes
a while still shows Waking, written once it has run ``WAKING_STATUS_AFTER_S``, and that write
lands before the wake's own result is taken (so before the round's publish).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from omnistage_operator.decisions.arbiter import SleepOrder, WorkerPhase
from omnistage_operator.decisions.facts import AckFacts
from omnistage_operator.decisions.handover import RoundOutcome, SleepResult
from omnistage_operator.k8s import port as port_module
from omnistage_operator.k8s.port import KubeGroupPort
from omnistage_operator.k8s.settings import Settings
from omnistage_operator.runtime.group_loops import BUSY_ROUNDS
from omnistage_operator.runtime.runner import GroupRunner


class Wakes:
    """A worker whose wake answers after ``delay_s``; what was written meanwhile is noted."""

    def __init__(self, delay_s: float, log: list[tuple[str, Any]]) -> None:
        self.delay_s = delay_s
        self.log = log

    async def wake(self, task_id: str, timeout_s: float, *, epoch: int = 0) -> AckFacts:
        await asyncio.sleep(self.delay_s)
        self.log.append(("woken", task_id))
        return AckFacts(task_id, True, "wake", WorkerPhase.ACTIVE)


def _port(
    delay_s: float, monkeypatch: pytest.MonkeyPatch
) -> tuple[KubeGroupPort, list[tuple[str, Any]]]:
    log: list[tuple[str, Any]] = []
    runner = GroupRunner(object(), Settings())  # type: ignore[arg-type]

    async def publish(port: Any, outcome: Any, *, events: bool = True, stages: Any = None) -> None:
        log.append(("write", stages))
        await asyncio.sleep(0.01)  # the API's answer
        log.append(("written", stages))

    monkeypatch.setattr(runner, "publish", publish)
    port = KubeGroupPort(runner, "ns", "g")
    monkeypatch.setattr(port, "_client", lambda stage: Wakes(delay_s, log))
    return port, log


def _outcome() -> RoundOutcome:
    ack = AckFacts("h1-a-sleep1", True, "sleep", WorkerPhase.ASLEEP, level=1)
    return RoundOutcome(sleeps=[SleepResult(SleepOrder("a", 1), "h1-a-sleep1", ack, 1)])


async def test_the_checkpoint_writes_the_sleepers_and_a_fast_wake_nothing_more(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    port, log = _port(0.0, monkeypatch)
    await port.checkpoint(_outcome())  # issued, not waited for: the wake goes out meanwhile
    await port.wake("b", "h1-b-wake")
    await port.checkpoint_written()
    assert log == [
        ("write", frozenset({"a"})),
        ("woken", "h1-b-wake"),
        ("written", frozenset({"a"})),
    ]


async def test_a_slow_wake_shows_waking_before_its_result_is_taken(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(port_module, "WAKING_STATUS_AFTER_S", 0.05)
    port, log = _port(0.2, monkeypatch)
    await port.checkpoint(_outcome())
    await port.wake("b", "h1-b-wake")
    assert log == [
        ("write", frozenset({"a"})),
        ("written", frozenset({"a"})),
        ("write", frozenset({"b"})),
        ("written", frozenset({"b"})),
        ("woken", "h1-b-wake"),
    ]


async def test_in_a_storm_only_a_wake_slower_still_shows_waking(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While the runner has a storm's rounds running, the same slow wake writes no Waking (its
    time is the storm's queues: the write would add to them); a wake slower than the storm's
    threshold still does."""
    monkeypatch.setattr(port_module, "WAKING_STATUS_AFTER_S", 0.05)
    monkeypatch.setattr(port_module, "WAKING_STATUS_IN_STORM_S", 0.4)
    port, log = _port(0.2, monkeypatch)
    port.r._in_round = BUSY_ROUNDS  # type: ignore[attr-defined]
    await port.checkpoint(_outcome())
    await port.wake("b", "h1-b-wake")
    await port.checkpoint_written()
    assert ("write", frozenset({"b"})) not in log and ("woken", "h1-b-wake") in log
    slow, slow_log = _port(0.6, monkeypatch)
    slow.r._in_round = BUSY_ROUNDS  # type: ignore[attr-defined]
    await slow.checkpoint(_outcome())
    await slow.wake("b", "h1-b-wake")
    assert slow_log[-3:] == [
        ("write", frozenset({"b"})),
        ("written", frozenset({"b"})),
        ("woken", "h1-b-wake"),
    ]


async def test_a_wake_without_a_checkpoint_writes_nothing_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(port_module, "WAKING_STATUS_AFTER_S", 0.0)
    port, log = _port(0.05, monkeypatch)
    await port.wake("b", "h1-b-wake")  # memory was free: no hand-over, no checkpoint
    assert log == [("woken", "h1-b-wake")]


async def test_a_waking_write_that_fails_is_not_the_wakes_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(port_module, "WAKING_STATUS_AFTER_S", 0.0)
    port, log = _port(0.05, monkeypatch)

    async def broken(*_: Any, **__: Any) -> None:
        raise RuntimeError("status not built")

    monkeypatch.setattr(port.r, "publish", broken)
    port._checkpointed = _outcome()  # a checkpoint ran
    ack = await port.wake("b", "h1-b-wake")
    assert ack.ok and log == [("woken", "h1-b-wake")]
