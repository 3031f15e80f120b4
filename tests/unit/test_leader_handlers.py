"""kopf handlers: a replica that does not lead writes nothing and keeps the finalizer; a spec
change is handled without a write (kopf's last-handled spec stays in memory)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import kopf
import pytest

from omnistage_operator.decisions.election import Timing
from omnistage_operator.decisions.leadership import NamespaceClaims
from omnistage_operator.k8s.claim_keeper import ClaimKeeper
from omnistage_operator.k8s.settings import Settings
from omnistage_operator.k8s.views import GroupViews
from omnistage_operator.runtime import handlers
from omnistage_operator.runtime.runner import GroupRunner


class Switch:
    """A leadership the test turns on and off."""

    def __init__(self, on: bool) -> None:
        self.on = on
        self.epoch = 3 if on else 0

    def leading(self) -> bool:
        return self.on


class RecordingRunner:
    """Records what the handlers asked of the runner (the runner itself is tested elsewhere).
    Whether it may order in a namespace is the real ``GroupRunner.may_order``, over the
    leadership and claims the handlers were configured with (``handlers.startup`` builds the
    runner with them); ``asked``: the namespaces it was asked about."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.published: dict[Any, Any] = {("ns", "x"): {"state": "Active"}}
        self.kept: dict[Any, Any] = {("ns", "g"): "readings of epoch 2"}
        self.asked: list[str] = []
        self.views = GroupViews({}, {})
        self.pipeline_status = self

    @property
    def leadership(self) -> Any:
        return handlers._State.leadership

    @property
    def claims(self) -> NamespaceClaims:
        return handlers._State.claims

    def may_order(self, namespace: str) -> bool:
        self.asked.append(namespace)
        return GroupRunner.may_order(self, namespace)  # type: ignore[arg-type]

    async def after_round(self, namespace: str, pipelines: list[Any], *_: Any, **__: Any) -> None:
        """``pipeline_status.after_round``: a pipeline's status written."""
        self.calls.append(("pipeline_status", pipelines[0]["metadata"]["name"]))

    def kick(self, namespace: str, group: str, cause: str = "event") -> None:
        self.calls.append(("kick", (namespace, group)))

    def kick_all(self) -> None:
        self.calls.append(("kick_all", None))

    def resync(self, namespace: str, group: str, interval_s: float) -> bool:
        self.calls.append(("resync", (namespace, group)))
        return True

    def record_ask(self, namespace: str, name: str) -> None:
        self.calls.append(("record_ask", name))

    async def settled(self, namespace: str, group: str, within_s: float) -> bool:
        self.calls.append(("settled", (namespace, group)))
        return True

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


def _configure(leading: bool, claims: NamespaceClaims | None = None) -> Switch:
    switch = Switch(leading)
    handlers.configure(Settings(retry_period_s=0.01), switch, claims)
    return switch


def _claimed_elsewhere() -> ClaimKeeper:
    """The shard's claims, ``ns``'s not held (not written yet, or another shard's)."""
    return ClaimKeeper(Timing(lease_duration_s=3, renew_deadline_s=2, retry_period_s=0.5), ["ns"])


async def _update() -> None:
    await H.stage_updated(
        body=BODY,
        old={"state": "Asleep", "colocation": {"group": "g"}},
        new=BODY["spec"],
        namespace="ns",
        name="x",
    )


async def test_a_standby_records_the_ask_and_returns_at_once(runner: RecordingRunner) -> None:
    _configure(leading=False)
    await _update()
    assert runner.ops() == ["record_ask", "kick"]


async def test_the_leader_writes_nothing_and_returns_after_the_round(
    runner: RecordingRunner,
) -> None:
    _configure(leading=True)
    await _update()
    # Nothing is written here: the round publishes the ask. kopf holds the stage's later
    # events (the round's own status writes) until the handler returns.
    assert runner.ops() == ["record_ask", "kick", "settled"]


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


@pytest.mark.parametrize(
    ("state", "status", "asks"),
    [
        ("Active", {"observedGeneration": 2, "state": "Asleep"}, True),  # asked while unseen
        ("Active", {"observedGeneration": 2, "requestedActiveAt": "2026-01-01T00:00:00Z"}, False),
        ("Active", {}, False),  # never written: it asks from its creation (port_facts)
        ("Asleep", {"observedGeneration": 2, "state": "Asleep"}, False),
    ],
)
async def test_a_stage_seen_first_asks_when_its_status_has_no_ask(
    runner: RecordingRunner, state: str, status: dict[str, Any], asks: bool
) -> None:
    _configure(leading=True)
    body = {**BODY, "spec": {**BODY["spec"], "state": state}, "status": status}
    await H.stage_created(body=body, namespace="ns", name="x")
    assert runner.ops() == (["record_ask", "kick"] if asks else ["kick"])


async def test_standby_keeps_the_finalizer_for_the_leader(runner: RecordingRunner) -> None:
    _configure(leading=False)
    with pytest.raises(kopf.TemporaryError, match="not the leader"):
        await H.stage_deleted(body=BODY, namespace="ns", name="x")
    # nothing deleted; what it kept of the stage (and of its group, after that kick) forgotten
    assert runner.ops() == ["forget", "kick"]
    _configure(leading=True)
    await H.stage_deleted(body=BODY, namespace="ns", name="x")
    assert runner.ops() == ["forget", "kick", "cleanup", "kick"]
    assert runner.asked == ["ns", "ns"]  # the runner's rule decides


async def test_a_leader_whose_shard_does_not_hold_the_namespace_keeps_the_finalizer(
    runner: RecordingRunner,
) -> None:
    _configure(leading=True, claims=_claimed_elsewhere())
    with pytest.raises(kopf.TemporaryError, match="another shard holds the namespace"):
        await H.stage_deleted(body=BODY, namespace="ns", name="x")
    assert runner.ops() == ["forget", "kick"] and runner.asked == ["ns"]


PIPELINE: dict[str, Any] = {
    "metadata": {"name": "p", "namespace": "ns"},
    "spec": {"stages": [{"name": "not-there"}]},
}


@pytest.mark.parametrize(
    ("leading", "claimed_elsewhere", "writes"),
    [(True, False, True), (False, False, False), (True, True, False)],
)
async def test_a_pipeline_with_no_stage_here_is_written_by_the_namespaces_shard_leader(
    runner: RecordingRunner, leading: bool, claimed_elsewhere: bool, writes: bool
) -> None:
    _configure(leading, _claimed_elsewhere() if claimed_elsewhere else None)
    await H.pipeline_event(type="ADDED", body=PIPELINE, namespace="ns")
    assert runner.ops() == (["pipeline_status"] if writes else [])
    assert runner.asked == ["ns"]


async def test_acquiring_kicks_every_group_and_forgets_what_was_published(
    runner: RecordingRunner,
) -> None:
    _configure(leading=True)
    handlers.on_acquired(3)
    assert runner.ops() == ["kick_all"]
    assert runner.published == {}
    assert runner.kept == {}  # its first rounds read every worker before they order


async def test_the_lease_taken_back_with_the_same_epoch_keeps_what_was_published(
    runner: RecordingRunner,
) -> None:
    _configure(leading=True)
    handlers.on_acquired(3)
    runner.published[("ns", "x")] = {"state": "Active"}
    runner.kept[("ns", "g")] = "readings of epoch 3"
    handlers.on_acquired(3)  # lost and taken back: nobody else held it (epoch unchanged)
    assert runner.published and runner.kept
    handlers.on_acquired(5)  # another replica led in between
    assert runner.published == {} and runner.kept == {}
    assert runner.ops() == ["kick_all"] * 3


async def test_kicks_reach_the_runner_whoever_leads(runner: RecordingRunner) -> None:
    _configure(leading=False)
    await H.resync(body=BODY, namespace="ns")
    await H.stage_created(body=BODY, namespace="ns", name="x")
    assert runner.calls == [("resync", ("ns", "g")), ("kick", ("ns", "g"))]
