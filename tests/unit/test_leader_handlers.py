"""kopf handlers of a replica that does not lead write nothing and keep the finalizer."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import kopf
import pytest

from omnistage_operator.k8s.settings import Settings
from omnistage_operator.runtime import handlers


class Switch:
    """A leadership the test turns on and off."""

    def __init__(self, on: bool) -> None:
        self.on = on
        self.epoch = 3 if on else 0

    def leading(self) -> bool:
        return self.on


class RecordingRunner:
    """Records what the handlers asked of the runner (the runner itself is tested elsewhere)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.published: dict[Any, Any] = {("ns", "x"): {"state": "Active"}}
        self.kept: dict[Any, Any] = {("ns", "g"): "readings of epoch 2"}

    def kick(self, namespace: str, group: str) -> None:
        self.calls.append(("kick", (namespace, group)))

    def kick_all(self) -> None:
        self.calls.append(("kick_all", None))

    def resync(self, namespace: str, group: str, interval_s: float) -> None:
        self.calls.append(("resync", (namespace, group)))

    def record_ask(self, namespace: str, name: str) -> None:
        self.calls.append(("record_ask", name))

    async def settled(self, namespace: str, group: str, within_s: float) -> bool:
        self.calls.append(("settled", (namespace, group)))
        return True

    async def persist_ask(self, namespace: str, name: str, *, written: bool = False) -> None:
        self.calls.append(("persist_ask", (name, written)))

    async def cleanup_stage(self, body: Any) -> None:
        self.calls.append(("cleanup", body["metadata"]["name"]))

    def forget(self, namespace: str, name: str) -> None:
        self.calls.append(("forget", name))

    def ops(self) -> list[str]:
        return [op for op, _ in self.calls]


# The kopf decorators type the handlers as kopf's callback protocols (every kwarg kopf passes);
# called directly here with the ones they use.
H: Any = handlers
BODY: dict[str, Any] = {
    "metadata": {"name": "x", "namespace": "ns"},
    "spec": {"state": "Active", "colocation": {"group": "g"}},
}


@pytest.fixture
def runner() -> Iterator[RecordingRunner]:
    r = RecordingRunner()
    handlers._State.runner = r  # type: ignore[assignment]
    yield r
    handlers._State.runner = None
    handlers.configure(Settings())


def _configure(leading: bool) -> Switch:
    switch = Switch(leading)
    handlers.configure(Settings(retry_period_s=0.01), switch)
    return switch


async def _update() -> None:
    await H.stage_updated(
        body=BODY,
        old={"state": "Asleep", "colocation": {"group": "g"}},
        new=BODY["spec"],
        namespace="ns",
        name="x",
    )


async def test_standby_records_the_ask_but_persists_nothing(runner: RecordingRunner) -> None:
    _configure(leading=False)
    await _update()
    assert runner.ops() == ["record_ask", "kick"]


async def test_leader_persists_the_ask_after_the_round_it_kicked(runner: RecordingRunner) -> None:
    _configure(leading=True)
    await _update()
    # kopf records the change once the handler returns: after the round (its hand-over), whose
    # status write carries the ask (persist_ask writes it only when that round did not).
    assert runner.ops() == ["record_ask", "kick", "settled", "persist_ask"]
    assert runner.calls[-1] == ("persist_ask", ("x", True))


async def test_a_change_to_asleep_waits_for_its_round_too(runner: RecordingRunner) -> None:
    _configure(leading=True)
    await H.stage_updated(
        body={**BODY, "spec": {**BODY["spec"], "state": "Asleep"}},
        old=BODY["spec"],
        new={**BODY["spec"], "state": "Asleep"},
        namespace="ns",
        name="x",
    )
    assert runner.ops() == ["kick", "settled"]


async def test_standby_that_becomes_leader_while_waiting_persists(
    runner: RecordingRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    switch = _configure(leading=False)
    real_sleep = H.asyncio.sleep

    async def acquire_meanwhile(delay: float) -> None:
        switch.on = True
        await real_sleep(0)

    monkeypatch.setattr(H.asyncio, "sleep", acquire_meanwhile)
    await _update()
    monkeypatch.undo()
    assert runner.ops()[-1] == "persist_ask"


async def test_standby_keeps_the_finalizer_for_the_leader(runner: RecordingRunner) -> None:
    _configure(leading=False)
    with pytest.raises(kopf.TemporaryError, match="not the leader"):
        await H.stage_deleted(body=BODY, namespace="ns", name="x")
    # nothing deleted; what it kept of the stage (and of its group, after that kick) forgotten
    assert runner.ops() == ["forget", "kick"]
    _configure(leading=True)
    await H.stage_deleted(body=BODY, namespace="ns", name="x")
    assert runner.ops() == ["forget", "kick", "cleanup", "kick"]


async def test_acquiring_kicks_every_group_and_forgets_what_was_published(
    runner: RecordingRunner,
) -> None:
    _configure(leading=True)
    handlers.on_acquired(3)
    assert runner.ops() == ["kick_all"]
    assert runner.published == {}
    assert runner.kept == {}  # its first rounds read every worker before they order


async def test_kicks_reach_the_runner_whoever_leads(runner: RecordingRunner) -> None:
    _configure(leading=False)
    await H.resync(body=BODY, namespace="ns")
    await H.stage_created(body=BODY, namespace="ns", name="x")
    assert runner.calls == [("resync", ("ns", "g")), ("kick", ("ns", "g"))]
