"""The namespace claim's gate in front of a group's rounds (``runtime.claim_gate``), on a real
``GroupRunner`` whose shard's claims are a real ``ClaimKeeper`` over in-memory Leases
(``MemoryLeases``) and a fake monotonic clock; the stages' status writes and Events go to
``Api``, which takes them as the API server would (or refuses them when told).

(``tests/unit/test_claim_gate.py`` is the worker's claim gate, ``engine.claims``.)
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import pytest
from prometheus_client import REGISTRY

from omnistage_operator.decisions.election import Timing
from omnistage_operator.decisions.namespace_claims import claim_holder, wait_message
from omnistage_operator.k8s import metrics
from omnistage_operator.k8s.claim_keeper import ClaimKeeper
from omnistage_operator.k8s.kube import OMNISTAGE, KubeError
from omnistage_operator.k8s.settings import Settings
from omnistage_operator.k8s.views import GroupViews, stage_keys
from omnistage_operator.runtime.claim_gate import CLAIM_REASON
from omnistage_operator.runtime.runner import GroupRunner
from tests.unit.test_leader_elector import Clock, MemoryLeases

T = Timing(lease_duration_s=3, renew_deadline_s=2, retry_period_s=0.5)
A, B = "ns-a/omnistage-operator", "ns-b/omnistage-operator"  # B: the runner's shard


class Api:
    """The stages' status patches and Events, taken as the API server takes them; ``refusing``
    status writes fail (a 503) until it is set back to 0."""

    def __init__(self) -> None:
        self.patches: list[tuple[str, Any]] = []  # (stage, status.namespaceClaim written)
        self.events: list[tuple[str, str, str, bool]] = []  # (stage, reason, message, warning)
        self.refusing = 0

    async def merge_patch(
        self, kind: Any, namespace: str, name: str, patch: Any, *, status: bool = False,
        answer: bool = True,
    ) -> Any:  # fmt: skip
        assert kind is OMNISTAGE and status and set(patch["status"]) == {"namespaceClaim"}
        if self.refusing:
            raise KubeError("the server is currently unable to handle the request", 503)
        self.patches.append((name, patch["status"]["namespaceClaim"]))
        return {}

    async def event(
        self, involved: Any, *, reason: str, message: str, warning: bool = False
    ) -> None:
        self.events.append((involved["metadata"]["name"], reason, message, warning))


class Leading:
    """This replica leads its shard (its Lease at epoch 1)."""

    epoch = 1

    def leading(self) -> bool:
        return True


def _stage(ns: str, name: str, status: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "apiVersion": "omnistage.io/v1alpha1",
        "kind": "OmniStage",
        "metadata": {"name": name, "namespace": ns, "uid": f"u-{name}"},
        "spec": {"colocation": {"group": "g"}},
    }
    if status is not None:
        body["status"] = status
    return body


def _views(*bodies: dict[str, Any]) -> GroupViews:
    """The stages' index as kopf builds it from ``stage_keys``."""
    index: dict[Any, list[dict[str, Any]]] = {}
    for body in bodies:
        for key, value in (stage_keys(body, body["metadata"]["namespace"]) or {}).items():
            index.setdefault(key, []).append(value)
    return GroupViews(index, {})


class Shards:
    """Shard A and shard B (the runner's) over one namespace's claim, on one clock."""

    def __init__(self, ns: str) -> None:
        self.ns = ns
        self.clock = Clock()
        self.leases = {ns: MemoryLeases()}
        self.changes: list[str] = []  # what B's keeper handed the loop (``on_claim_changed``)
        self.a = ClaimKeeper(T, [ns], clock=self.clock)
        self.b = ClaimKeeper(T, [ns], clock=self.clock, on_change=self.changes.append)
        self.a.bind(A, lambda n: self.leases[n])
        self.b.bind(B, lambda n: self.leases[n])

    async def tick(self, keeper: ClaimKeeper, leader: str) -> None:
        await asyncio.gather(*keeper.tick(leader))

    async def b_takes_over(self) -> None:
        """A writes no more: B ticks every retry period until its claim is B's."""
        while not self.b.held(self.ns):
            self.clock.t += T.retry_period_s
            await self.tick(self.b, "op-b")


def _runner(api: Api, claims: ClaimKeeper, *bodies: dict[str, Any]) -> GroupRunner:
    return GroupRunner(api, Settings(), Leading(), _views(*bodies), claims)  # type: ignore[arg-type]


def _rounds(ns: str, outcome: str) -> float:
    return float(metrics.ROUNDS.labels(ns, "g", outcome)._value.get())


def _claimed_by(ns: str, holder: str) -> float | None:
    labels = {"namespace": ns, "holder": holder}
    return REGISTRY.get_sample_value("omnistage_namespace_claimed_by_other_shard", labels)


async def _until(what: str, ok: Any, within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while not ok():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.001)


def _emitted(caplog: pytest.LogCaptureFixture, ns: str) -> list[str]:
    """The Events emitted in ``ns`` (``emit`` logs each one as it posts it)."""
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"{ns}/s")]


def _waits(caplog: pytest.LogCaptureFixture, ns: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"group {ns}/g ")]


async def test_before_the_first_claim_write_no_round_runs_and_nothing_is_written() -> None:
    shards, api = Shards("gate-pending"), Api()
    runner = _runner(api, shards.b, _stage("gate-pending", "s1"))
    before = _rounds("gate-pending", "claim_pending")
    assert not await runner.claim_gate("gate-pending", "g")
    assert not await runner.round("gate-pending", "g")  # the round asks the gate first
    assert _rounds("gate-pending", "claim_pending") == before + 2
    assert api.patches == [] and api.events == []


async def test_another_shards_claim_holds_the_rounds_and_each_stage_is_told_once_per_holder(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ns = "gate-other"
    shards, api = Shards(ns), Api()
    runner = _runner(api, shards.b, _stage(ns, "s1"), _stage(ns, "s2"))
    caplog.set_level(logging.INFO)
    await shards.tick(shards.a, "op-a1")
    await shards.tick(shards.b, "op-b")
    first = claim_holder(A, "op-a1")
    assert shards.b.claimant(ns) == first and shards.changes == [ns]
    assert _claimed_by(ns, first) == 1
    assert f"namespace {ns} is claimed by another shard: {first}" in caplog.messages

    before = _rounds(ns, "namespace_claimed")
    assert not await runner.claim_gate(ns, "g")
    message = wait_message(ns, B, first)
    wait = {
        "reason": CLAIM_REASON,
        "shard": B,
        "claimedBy": A,
        "holder": first,
        "message": message,
    }
    assert sorted(api.patches) == [("s1", wait), ("s2", wait)]
    await _until("two Events", lambda: len(api.events) == 2)
    assert sorted(api.events) == [(s, CLAIM_REASON, message, True) for s in ("s1", "s2")]
    assert _waits(caplog, ns) == [f"group {ns}/g waits: {message}"]
    assert _rounds(ns, "namespace_claimed") == before + 1

    # every round skipped counts; the stages were told: no write, Event or log line again
    assert not await runner.claim_gate(ns, "g")
    assert not await runner.round(ns, "g")
    assert _rounds(ns, "namespace_claimed") == before + 3
    assert len(api.patches) == 2 and len(_waits(caplog, ns)) == 1
    assert len(_emitted(caplog, ns)) == 2  # Events are posted as they are emitted

    # A's next leader takes A's claim back: another holder, told again
    shards.clock.t += T.retry_period_s
    await shards.tick(shards.a, "op-a2")
    await shards.tick(shards.b, "op-b")
    second = claim_holder(A, "op-a2")
    assert shards.b.claimant(ns) == second
    assert _claimed_by(ns, first) is None and _claimed_by(ns, second) == 1  # one series
    assert not await runner.claim_gate(ns, "g")
    assert [claim["holder"] for _, claim in api.patches[2:]] == [second, second]
    await _until("two more Events", lambda: len(api.events) == 4)
    assert len(_waits(caplog, ns)) == 2


async def test_the_claim_taken_clears_the_waits_this_shard_wrote_and_only_those() -> None:
    ns = "gate-taken"
    shards, api = Shards(ns), Api()
    theirs = {"reason": CLAIM_REASON, "shard": "ns-c/omnistage-operator", "holder": "x"}
    mine_before = {"reason": CLAIM_REASON, "shard": B, "holder": "x"}  # a previous process's
    bodies = [
        _stage(ns, "s1"),
        _stage(ns, "s2", {"namespaceClaim": mine_before}),
        _stage(ns, "s3", {"namespaceClaim": theirs}),  # a third shard's wait: not B's to clear
    ]
    runner = _runner(api, shards.b, *bodies)
    await shards.tick(shards.a, "op-a")
    await shards.tick(shards.b, "op-b")
    assert not await runner.claim_gate(ns, "g")
    assert sorted(name for name, _ in api.patches) == ["s1", "s2", "s3"]
    api.patches.clear()

    shards.changes.clear()
    await shards.b_takes_over()  # A stopped renewing: expired on B's clock
    assert shards.changes == [ns] and shards.b.claimant(ns) is None
    assert _claimed_by(ns, claim_holder(A, "op-a")) is None
    assert await runner.claim_gate(ns, "g")
    assert sorted(api.patches) == [("s1", None), ("s2", None), ("s3", None)]  # told, all three
    api.patches.clear()
    assert await runner.claim_gate(ns, "g")  # the watch has not delivered the clears yet
    assert sorted(api.patches) == [("s2", None)]  # still shows B's wait as the watch saw it

    # a later process of shard B, which told no stage: only B's own wait is cleared
    api.patches.clear()
    fresh = _runner(api, shards.b, *bodies)
    assert await fresh.claim_gate(ns, "g")
    assert api.patches == [("s2", None)]


async def test_a_claim_taken_again_forgets_what_this_shard_wrote_and_read_there() -> None:
    ns = "gate-epochs"
    shards, api = Shards(ns), Api()
    runner = _runner(api, shards.b, _stage(ns, "s1"))
    await shards.tick(shards.b, "op-b")
    assert await runner.claim_gate(ns, "g")
    runner.published[(ns, "s1")] = {"state": "Active"}
    runner.published[("elsewhere", "s9")] = {"state": "Active"}
    runner.kept[(ns, "g")] = runner.kept[("elsewhere", "g")] = "readings"  # type: ignore[assignment]
    assert await runner.claim_gate(ns, "g")  # the same claim: what it wrote stands
    assert (ns, "s1") in runner.published and (ns, "g") in runner.kept

    # B stops renewing; A takes the namespace over, then stops and releases it; B takes it back
    last = shards.clock.t
    while not shards.a.held(ns):
        shards.clock.t += T.retry_period_s
        await shards.tick(shards.a, "op-a")
    assert shards.clock.t - last >= T.lease_duration_s and not shards.b.held(ns)
    await shards.a.release()
    await shards.b_takes_over()
    assert runner.epoch_for(ns) > 2**32  # the claim's third holder
    assert await runner.claim_gate(ns, "g")
    assert (ns, "s1") not in runner.published and (ns, "g") not in runner.kept
    assert ("elsewhere", "s9") in runner.published and ("elsewhere", "g") in runner.kept


async def test_a_wait_the_api_did_not_take_is_written_at_the_next_round() -> None:
    ns = "gate-unwritten"
    shards, api = Shards(ns), Api()
    runner = _runner(api, shards.b, _stage(ns, "s1"))
    await shards.tick(shards.a, "op-a")
    await shards.tick(shards.b, "op-b")
    api.refusing = 1
    assert not await runner.claim_gate(ns, "g")
    assert api.patches == []
    api.refusing = 0
    assert not await runner.claim_gate(ns, "g")
    assert [(name, claim["holder"]) for name, claim in api.patches] == [
        ("s1", claim_holder(A, "op-a"))
    ]
    await _until("its Event", lambda: len(api.events) == 1)  # with the write that went through


async def test_a_clear_the_api_did_not_take_is_tried_again_at_the_next_round() -> None:
    """The watch has not shown the wait (its status as the round sees it has none): only what
    this shard remembers telling the stage says it is there."""
    ns = "gate-uncleared"
    shards, api = Shards(ns), Api()
    runner = _runner(api, shards.b, _stage(ns, "s1"))
    await shards.tick(shards.a, "op-a")
    await shards.tick(shards.b, "op-b")
    assert not await runner.claim_gate(ns, "g")
    await shards.b_takes_over()
    api.patches.clear()
    api.refusing = 1
    assert await runner.claim_gate(ns, "g")  # the round runs; the wait is still there
    api.refusing = 0
    assert await runner.claim_gate(ns, "g")
    assert api.patches == [("s1", None)]
    assert await runner.claim_gate(ns, "g")
    assert api.patches == [("s1", None)]  # cleared once
