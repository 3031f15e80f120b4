"""The runner lets go of a deleted group and of its stages (issue 24: memory follows the stages
that exist), but not during a round, and not when the group is re-created under the same name
meanwhile; the sleeps its rounds left running are cancelled with it. A deleted pipeline's
counters go too.

The runner is the real one (its loops, its rounds' bookkeeping, the watch views); only the body
of a round is a stand-in that leaves what a real round leaves: kept readings, a sleep tracker,
facts of each stage it listed, a channel per stage.
"""

from __future__ import annotations

import asyncio
from typing import Any

from prometheus_client import REGISTRY

from omnistage_operator.decisions.election import Timing
from omnistage_operator.decisions.handover.sleep_tasks import SleepTracker
from omnistage_operator.decisions.leadership import NamespaceClaims
from omnistage_operator.decisions.readings import KeptReadings
from omnistage_operator.decisions.retention import GROUP_MAPS, PROCESS_MAPS, STAGE_MAPS, left, live
from omnistage_operator.k8s import metrics
from omnistage_operator.k8s.claim_keeper import ClaimKeeper
from omnistage_operator.k8s.port import KubeGroupPort
from omnistage_operator.k8s.settings import Settings
from omnistage_operator.k8s.views import GroupViews
from omnistage_operator.runtime import stage_metrics
from omnistage_operator.runtime.pipeline_status import PIPELINE_SWAPS, PipelineStatus, _Counts
from omnistage_operator.runtime.runner import GroupRunner
from tests.unit.test_leader_elector import Clock, MemoryLeases

Body = dict[str, Any]


class _NoKube:
    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the API was called ({name})")


class _Channel:
    closed = False

    async def close(self) -> None:
        self.closed = True


def _body(name: str, uid: str, group: str = "g", *, deleting: bool = False) -> Body:
    meta: Body = {"name": name, "namespace": "ns", "uid": uid}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "spec": {"colocation": {"group": group}}}


class Index(dict[Any, list[Body]]):
    """kopf's stage index, as the watch would change it."""

    def put(self, body: Body) -> None:
        self.drop(body["metadata"]["name"])
        group = body["spec"]["colocation"]["group"]
        self.setdefault(("group", "ns", group), []).append(body)
        self[("name", "ns", body["metadata"]["name"])] = [body]

    def drop(self, name: str) -> None:
        old = self.pop(("name", "ns", name), None)
        if old:
            key = ("group", "ns", old[0]["spec"]["colocation"]["group"])
            rest = [b for b in self.get(key, []) if b["metadata"]["name"] != name]
            if rest:
                self[key] = rest
            else:
                self.pop(key, None)


class Runner(GroupRunner):
    """Rounds that list the group from the views and leave what a real round leaves; the
    next round waits while ``gate`` is clear."""

    def __init__(self, index: Index, claims: NamespaceClaims | None = None) -> None:
        views = GroupViews(index, {})
        super().__init__(_NoKube(), Settings(), views=views, claims=claims)  # type: ignore[arg-type]
        self.gate = asyncio.Event()
        self.gate.set()
        self.rounds = 0
        self.busy = False  # what the round says: something in progress, poll again
        self.channels_made: list[_Channel] = []

    async def _round_of(self, port: KubeGroupPort, namespace: str, group: str) -> bool:
        self.rounds += 1
        await self.gate.wait()
        for body in self.views.stages(namespace, group):
            name = body["metadata"]["name"]
            port.bodies[name] = body
            self.asks[(namespace, name)] = 1.0
            self.published[(namespace, name)] = {"state": "Active"}
            self.adopted.add((namespace, name))
            uid = body["metadata"]["uid"]
            self.channels.get((namespace, name), uid, "t", self._channel)  # type: ignore[arg-type]
        self.kept[(namespace, group)] = KeptReadings({}, {}, 1, 0.0)
        self._sleeps.setdefault((namespace, group), SleepTracker()).collect()  # ended sleeps
        metrics.ROUNDS.labels(namespace, group, "idle").inc()
        return self.busy

    def _channel(self) -> _Channel:
        self.channels_made.append(_Channel())
        return self.channels_made[-1]

    def entries(self, scope: str) -> float:
        value = REGISTRY.get_sample_value("omnistage_runner_entries", {"scope": scope})
        assert value is not None
        return value

    async def idle(self) -> None:
        """Until every loop has ended (a loop may start another round)."""
        for _ in range(200):
            tasks = [lp.task for lp in self._loops.values() if lp.task and not lp.task.done()]
            if not tasks:
                await asyncio.sleep(0)
                return
            await asyncio.gather(*tasks)
        raise AssertionError("loops never ended")


def _group_series(group: str) -> float | None:
    labels = {"namespace": "ns", "group": group, "outcome": "idle"}
    return REGISTRY.get_sample_value("omnistage_rounds_total", labels)


def test_every_map_of_the_runner_is_forgotten_with_its_stage_or_its_group() -> None:
    runner = GroupRunner(_NoKube(), Settings())  # type: ignore[arg-type]
    held = {k for k, v in vars(runner).items() if isinstance(v, dict | set)}
    listed = set(STAGE_MAPS) | set(GROUP_MAPS) | set(PROCESS_MAPS)
    assert held == listed, (held - listed, listed - held)
    assert not set(STAGE_MAPS) & set(GROUP_MAPS)


def test_a_group_is_live_while_a_stage_is_not_being_deleted() -> None:
    assert not live([])
    assert not live([_body("a", "1", deleting=True)])
    assert live([_body("a", "1", deleting=True), _body("b", "2")])


def test_a_stage_left_when_gone_or_re_created() -> None:
    seen = {"a": _body("a", "1"), "c": _body("c", "9")}
    members = {"a": "1", "b": "2", "c": "3"}
    assert left(members, seen.get) == ["b", "c"]  # b gone, c re-created (another uid)


async def test_a_deleted_group_is_forgotten_once_its_round_in_flight_ends() -> None:
    index = Index()
    index.put(_body("a", "1"))
    index.put(_body("b", "2"))
    runner = Runner(index)
    runner.kick("ns", "g")
    await runner.idle()
    assert runner.entries("group") >= 3 and runner.entries("stage") >= 6
    assert runner.entries("channel") == 2 and _group_series("g") == 1.0

    runner.gate.clear()
    runner.kick("ns", "g")  # a round in flight when the delete arrives
    await asyncio.sleep(0)
    index.put(_body("a", "1", deleting=True))
    index.put(_body("b", "2", deleting=True))
    runner.forget("ns", "a")  # the delete handlers' own forget, during the round
    runner.forget("ns", "b")
    await asyncio.sleep(0.01)
    assert ("ns", "g") in runner._loops and ("ns", "g") in runner._sleeps  # not mid-round
    runner.gate.set()
    await runner.idle()
    # the round wrote the stages' facts again; the loop's end forgot them with the group
    assert runner.entries("group") == runner.entries("stage") == 0
    assert runner.entries("channel") == 0 and all(c.closed for c in runner.channels_made)
    index.drop("a")
    index.drop("b")
    assert stage_metrics.flush_groups() == 1 and _group_series("g") is None


async def test_a_stage_deleted_from_a_live_group_is_forgotten_by_the_next_round() -> None:
    index = Index()
    index.put(_body("a", "1"))
    index.put(_body("b", "2"))
    runner = Runner(index)
    runner.kick("ns", "g")
    await runner.idle()
    index.drop("b")  # gone from the watch after a round wrote its facts
    runner.kick("ns", "g")
    await runner.idle()
    assert ("ns", "b") not in runner.asks and ("ns", "b") not in runner.published
    assert ("ns", "a") in runner.asks and ("ns", "g") in runner._loops


async def test_a_gone_group_is_dropped_with_the_follow_up_its_last_round_asked_for() -> None:
    index = Index()
    index.put(_body("a", "1"))
    runner = Runner(index)
    runner.kick("ns", "g")
    await runner.idle()
    loop = runner._loops[("ns", "g")]
    index.drop("a")
    runner.busy = True  # e.g. the deleted stage's pod still terminating, or a crash back-off
    runner.kick("ns", "g")
    await runner.idle()
    assert ("ns", "g") not in runner._loops
    assert loop.followup is not None and loop.followup.cancelled()


async def test_a_group_re_created_during_its_last_round_keeps_its_loop() -> None:
    index = Index()
    index.put(_body("a", "1"))
    runner = Runner(index)
    runner.kick("ns", "g")
    await runner.idle()
    runner.gate.clear()
    runner.kick("ns", "g")
    await asyncio.sleep(0)
    index.drop("a")  # deleted ...
    index.put(_body("a", "7"))  # ... and re-created under the same name
    runner.kick("ns", "g")  # its create handler's kick, during the round
    runner.gate.set()
    await runner.idle()
    assert ("ns", "g") in runner._loops and ("ns", "g") in runner.kept
    assert runner._members[("ns", "g")] == {"a": "7"}
    assert runner.asks[("ns", "a")] == 1.0  # the new stage's, written after the old was forgotten


async def test_a_gone_group_s_sleeps_in_flight_are_cancelled_with_it() -> None:
    index = Index()
    index.put(_body("a", "1"))
    runner = Runner(index)
    runner.kick("ns", "g")
    await runner.idle()
    tracker = runner._sleeps[("ns", "g")]
    tracker.open("h1")
    retry = asyncio.Event()
    reopened: list[_Channel] = []

    async def sleeping() -> Any:  # a sleep retried until its window ends
        await retry.wait()  # its next attempt, after the stage was forgotten: a new channel
        reopened.append(_Channel())
        runner.channels.get(("ns", "a"), "1", "t", lambda: reopened[-1])  # type: ignore[arg-type,return-value]
        await asyncio.Event().wait()

    order = type("Order", (), {"stage": "a", "releases_memory": True})()
    tracker.launch(order, sleeping())
    (task,) = [t for _, t in tracker._tasks.values()]
    index.drop("a")
    runner.gate.clear()
    runner.kick("ns", "g")
    await asyncio.sleep(0.01)  # the round began: the stage that left was forgotten before it
    assert ("ns", "a") not in runner.asks and runner.entries("channel") == 0
    retry.set()
    await asyncio.sleep(0.01)
    assert runner.entries("channel") == 1
    runner.gate.set()
    await runner.idle()
    assert ("ns", "g") not in runner._loops and ("ns", "g") not in runner._sleeps
    await asyncio.sleep(0.01)
    assert task.cancelled() and reopened[0].closed and runner.entries("channel") == 0


async def test_the_namespace_s_claim_is_let_go_once_its_last_group_is() -> None:
    """Cluster-wide, the shard claimed ``ns`` when a round asked: with its last group dropped,
    the claim goes a lease duration later (``ClaimKeeper.vacated``), not with another group."""
    timing, clock, lease = Timing(3, 2, 0.5), Clock(), MemoryLeases()
    keeper = ClaimKeeper(timing, clock=clock)
    keeper.bind("op-ns/omnistage-operator", lambda _: lease)
    index = Index()
    index.put(_body("a", "1", "g"))
    index.put(_body("b", "2", "h"))
    runner = Runner(index, keeper)

    async def retry_period() -> None:
        clock.t += timing.retry_period_s
        await asyncio.gather(*keeper.tick("op-0"))

    for group in ("g", "h"):
        runner.kick("ns", group)  # claim_pending: the round asked for the namespace
    await runner.idle()
    await retry_period()
    for group in ("g", "h"):
        runner.kick("ns", group)
    await runner.idle()
    assert keeper.held("ns") and runner.rounds == 2 and "ns" in runner.claim_epochs
    index.drop("a")  # g goes; h is left
    runner.kick("ns", "g")
    await runner.idle()
    assert ("ns", "g") not in runner._loops
    for _ in range(int(timing.lease_duration_s / timing.retry_period_s) + 1):
        await retry_period()
    assert keeper.held("ns")
    index.drop("b")  # the last group goes
    runner.kick("ns", "h")
    await runner.idle()
    assert "ns" not in runner.claim_epochs
    left_at = clock.t
    for _ in range(20):
        await retry_period()
        if not keeper.held("ns"):
            break
    assert not keeper.held("ns") and clock.t - left_at >= timing.lease_duration_s
    assert lease.obj is not None and lease.obj["spec"].get("holderIdentity") is None


def test_a_deleted_pipeline_s_counters_and_series_go() -> None:
    status = PipelineStatus(_NoKube(), lambda *a, **k: None)  # type: ignore[arg-type]
    status.counts[("ns", "p")] = _Counts(swaps=3, batches=4)
    PIPELINE_SWAPS.labels("ns", "p").inc()
    status.forget("ns", "p")
    assert not status.counts
    assert (
        REGISTRY.get_sample_value(
            "omnistage_pipeline_swaps_total", {"namespace": "ns", "pipeline": "p"}
        )
        is None
    )
