"""Namespace claims between shards: the pure decisions, and the keeper against in-memory Leases
with the API server's concurrency rules (``MemoryLeases``: resourceVersion preconditions, a
renewal refused once its holder or transitions changed) on a fake monotonic clock."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

from prometheus_client import REGISTRY

from omnistage_operator.decisions.election import Action, LeaseRecord, Observation, Tenure, Timing
from omnistage_operator.decisions.namespace_claims import (
    ClaimState,
    claim_dropped,
    claim_holder,
    claim_write,
    decide_claim,
    holds,
    order_epoch,
    shard_of,
    wait_message,
)
from omnistage_operator.k8s.claim_keeper import ClaimKeeper
from tests.unit.test_leader_elector import Clock, MemoryLeases

T = Timing(lease_duration_s=3, renew_deadline_s=2, retry_period_s=0.5)
A, B = "ns-a/omnistage-operator", "ns-b/omnistage-operator"
NOW = datetime(2026, 11, 29, 22, 0, 0, tzinfo=UTC)


def _obs(holder: str, at: float, rv: str = "7", transitions: int = 1) -> Observation:
    return Observation(LeaseRecord(rv, holder, 3, transitions), at)


def test_the_holder_names_the_shard_and_its_leader() -> None:
    holder = claim_holder(A, "op-0_ab12")
    assert holder == "ns-a/omnistage-operator#op-0_ab12"
    assert shard_of(holder) == A
    assert shard_of("some-other-tool") == "some-other-tool"


def test_decide_claim() -> None:
    assert decide_claim(A, None, 0.0, T) is Action.CREATE
    # this shard's, written by another of its replicas: taken back at once (no expiry wait)
    assert decide_claim(A, _obs(claim_holder(A, "op-1_x"), 100.0), 100.5, T) is Action.RENEW
    # another shard's, still renewed: wait; expired on this clock, or no holder: take over
    assert decide_claim(B, _obs(claim_holder(A, "op-0"), 100.0), 102.9, T) is Action.WAIT
    assert decide_claim(B, _obs(claim_holder(A, "op-0"), 100.0), 103.0, T) is Action.TAKE_OVER
    assert decide_claim(B, _obs("", 100.0), 100.0, T) is Action.TAKE_OVER


def test_taking_back_keeps_the_transitions_taking_over_raises_them() -> None:
    mine = _obs(claim_holder(A, "op-1"), 0.0, transitions=4)
    spec, n = claim_write(Action.RENEW, claim_holder(A, "op-2"), mine, NOW, T)
    assert n == 4 and spec["holderIdentity"] == claim_holder(A, "op-2")
    spec, n = claim_write(Action.TAKE_OVER, claim_holder(B, "op-9"), mine, NOW, T)
    assert n == 5 and spec["leaseTransitions"] == 5 and "acquireTime" in spec
    spec, n = claim_write(Action.CREATE, claim_holder(B, "op-9"), None, NOW, T)
    assert n == 1 and spec["leaseDurationSeconds"] == 3


def test_a_shard_stops_holding_before_another_may_take_over() -> None:
    """Held until the renew deadline after the last write was sent; another shard, which saw
    that write only after it was sent, may take over only a lease duration after seeing it."""
    sent = 100.0
    state = ClaimState(_obs(claim_holder(A, "op-0"), sent), Tenure(1, sent))
    assert holds(state, sent + T.renew_deadline_s - 0.01, T)
    assert not holds(state, sent + T.renew_deadline_s, T)
    assert not holds(ClaimState(), sent, T) and not holds(None, sent, T)
    for seen in (sent, sent + 0.7):  # the other shard saw the write at or after it was sent
        first_take = seen + T.lease_seconds
        assert decide_claim(B, _obs(claim_holder(A, "op-0"), seen), first_take, T) is (
            Action.TAKE_OVER
        )
        assert not holds(state, first_take, T)


def test_order_epochs_rise_with_every_change_of_shard() -> None:
    assert order_epoch(1, 7) == 7  # the first claim: the shard's own epoch, as before claims
    assert order_epoch(0, 7) == 7
    assert order_epoch(1, 0) == order_epoch(3, 0) == 0  # no election: epoch 0 everywhere
    # shard B (its Lease at epoch 1) takes over from shard A (its Lease at epoch 40)
    assert order_epoch(2, 1) > order_epoch(1, 40)
    assert order_epoch(2, 1) > order_epoch(1, 2**32 - 1)
    # within one claim the shard's own epochs keep their order; A back later is above B
    assert order_epoch(2, 2) > order_epoch(2, 1)
    assert order_epoch(3, 40) > order_epoch(2, 10**6)
    assert order_epoch(3, 40) < 2**63  # an int64 on the wire


def test_wait_message_names_the_other_shard_and_its_leader() -> None:
    msg = wait_message("team-a", B, claim_holder(A, "op-0_ab"))
    assert "claimed by shard ns-a/omnistage-operator (leader op-0_ab)" in msg
    assert "shard ns-b/omnistage-operator orders no worker here" in msg


def test_a_claim_is_dropped_a_lease_duration_after_its_namespace_lost_its_last_group() -> None:
    assert not claim_dropped(None, 1e9, T)  # a group is there (or never left)
    assert not claim_dropped(100.0, 100.0 + T.lease_duration_s - 0.01, T)
    assert claim_dropped(100.0, 100.0 + T.lease_duration_s, T)


# -- the keeper -------------------------------------------------------------------------------


def _keeper(
    shard: str, stores: dict[str, MemoryLeases], clock: Clock, changes: list[str], *ns: str
) -> ClaimKeeper:
    keeper = ClaimKeeper(T, ns, clock=clock, on_change=changes.append)
    keeper.bind(shard, lambda n: stores[n])
    return keeper


async def _tick(keeper: ClaimKeeper, leader: str) -> None:
    await asyncio.gather(*keeper.tick(leader))


async def test_the_second_shard_waits_naming_the_first_and_takes_over_once_it_expired() -> None:
    stores, clock = {"team-a": MemoryLeases(), "team-b": MemoryLeases()}, Clock()
    seen_a: list[str] = []
    seen_b: list[str] = []
    a = _keeper(A, stores, clock, seen_a, "team-a")
    b = _keeper(B, stores, clock, seen_b, "team-b", "team-a")
    await _tick(a, "op-a_1")
    assert a.held("team-a") and seen_a == ["team-a"]
    await _tick(b, "op-b_1")
    assert b.held("team-b") and not b.held("team-a")
    assert b.claimant("team-a") == claim_holder(A, "op-a_1")
    assert sorted(seen_b) == ["team-a", "team-b"]  # claimed one, found the other's holder
    # a renews every retry period: b keeps waiting, whatever the time
    for _ in range(10):
        clock.t += T.retry_period_s
        await _tick(a, "op-a_1")
        await _tick(b, "op-b_1")
        assert a.held("team-a") and not b.held("team-a")
    assert stores["team-a"].writes.count(("renew", claim_holder(A, "op-a_1"))) == 10
    # a stops (no more renewals): it stops holding at its renew deadline, b takes over only
    # once the record has been unchanged for the lease duration on b's clock
    seen_b.clear()
    last_renewal = clock.t
    while not b.held("team-a"):
        clock.t += T.retry_period_s
        await _tick(b, "op-b_1")
        assert not (a.held("team-a") and b.held("team-a"))
    assert clock.t - last_renewal >= T.lease_duration_s
    assert not a.held("team-a") and b.claimant("team-a") is None
    assert seen_b == ["team-a"]
    assert stores["team-a"].obj is not None
    spec = stores["team-a"].obj["spec"]
    assert spec["holderIdentity"] == claim_holder(B, "op-b_1") and spec["leaseTransitions"] == 2
    assert b.epoch("team-a", 1) > a.epoch("team-a", 5) == 5  # b's orders there rank above a's
    # a comes back: it finds b's claim, waits, and its old tenure no longer renews
    await _tick(a, "op-a_1")
    assert not a.held("team-a") and a.claimant("team-a") == claim_holder(B, "op-b_1")


async def test_a_standby_of_the_same_shard_keeps_the_claim() -> None:
    stores, clock = {"team-a": MemoryLeases()}, Clock()
    changes: list[str] = []
    old = _keeper(A, stores, clock, changes, "team-a")
    await _tick(old, "op-0_1")
    assert old.held("team-a")
    other = _keeper(B, stores, clock, changes, "team-a")
    new = _keeper(A, stores, clock, changes, "team-a")  # the shard's next leader
    clock.t += T.retry_period_s
    await _tick(new, "op-1_2")  # at once: no expiry wait, the transitions kept
    assert new.held("team-a")
    assert stores["team-a"].obj is not None
    spec = stores["team-a"].obj["spec"]
    assert spec["holderIdentity"] == claim_holder(A, "op-1_2") and spec["leaseTransitions"] == 1
    clock.t += T.renew_deadline_s  # the old leader no longer leads: it writes nothing more
    await _tick(new, "op-1_2")
    assert new.held("team-a") and not old.held("team-a")
    await _tick(other, "op-b")
    assert not other.held("team-a") and other.claimant("team-a") == claim_holder(A, "op-1_2")


async def test_a_released_claim_is_taken_at_once_above_the_old_epochs() -> None:
    stores, clock = {"team-a": MemoryLeases()}, Clock()
    a = _keeper(A, stores, clock, [], "team-a")
    b = _keeper(B, stores, clock, [], "team-a")
    await _tick(a, "op-a")
    await _tick(b, "op-b")
    assert a.held("team-a") and b.claimant("team-a") == claim_holder(A, "op-a")
    await a.release()  # a stops: it holds nothing from here on, the holder is cleared
    assert not a.held("team-a")
    assert stores["team-a"].obj is not None
    assert stores["team-a"].obj["spec"].get("holderIdentity") is None  # merge patch: removed
    clock.t += T.retry_period_s  # far below the lease duration: no expiry wait
    await _tick(b, "op-b")
    assert b.held("team-a") and b.epoch("team-a", 1) > a.epoch("team-a", 9)
    await a.release()  # nothing held: nothing written
    assert stores["team-a"].obj["spec"]["holderIdentity"] == claim_holder(B, "op-b")


async def test_a_release_that_cannot_reach_the_api_leaves_the_claim_to_expire() -> None:
    stores, clock = {"team-a": MemoryLeases()}, Clock()
    a = _keeper(A, stores, clock, [], "team-a")
    await _tick(a, "op-a")
    stores["team-a"].cut = True
    await asyncio.wait_for(a.release(), 5)  # bounded by half the renew deadline
    assert not a.held("team-a")


async def test_patterns_are_not_claimed_until_a_round_wants_their_namespace() -> None:
    stores, clock = {"team-a": MemoryLeases(), "team-x1": MemoryLeases()}, Clock()
    keeper = _keeper(A, stores, clock, [], "team-a", "team-x*", "!kube-system")
    await _tick(keeper, "op-0")
    assert keeper.held("team-a") and stores["team-x1"].obj is None
    keeper.want("team-x1")  # cluster-wide or a pattern: claimed once a group's round asks
    await _tick(keeper, "op-0")
    assert keeper.held("team-x1")


async def test_an_unreachable_api_lets_the_claim_lapse() -> None:
    stores, clock = {"team-a": MemoryLeases()}, Clock()
    keeper = _keeper(A, stores, clock, [], "team-a")
    await _tick(keeper, "op-0")
    assert keeper.held("team-a")
    stores["team-a"].cut = True
    tasks = keeper.tick("op-0")
    clock.t += T.renew_deadline_s
    assert not keeper.held("team-a")  # lapsed while the renewal hangs
    assert keeper.tick("op-0") == []  # one write in flight per namespace at a time
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _held_series(namespace: str) -> float | None:
    return REGISTRY.get_sample_value("omnistage_namespace_claim_held", {"namespace": namespace})


def _claimed_by_series(namespace: str, holder: str) -> float | None:
    labels = {"namespace": namespace, "holder": holder}
    return REGISTRY.get_sample_value("omnistage_namespace_claimed_by_other_shard", labels)


async def test_a_namespace_without_group_for_a_lease_duration_is_released_and_forgotten() -> None:
    ns = "drop-held"
    stores, clock = {ns: MemoryLeases()}, Clock()
    a = _keeper(A, stores, clock, [])  # cluster-wide: no list
    b = _keeper(B, stores, clock, [])
    a.want(ns)  # a round of its first group asked
    await _tick(a, "op-a")
    assert a.held(ns) and _held_series(ns) == 1.0
    a.vacated(ns)  # its last group was dropped
    left_at = clock.t
    while clock.t + T.retry_period_s < left_at + T.lease_duration_s:
        clock.t += T.retry_period_s
        await _tick(a, "op-a")
        assert a.held(ns)  # kept (and renewed) for a lease duration
    clock.t = left_at + T.lease_duration_s
    renewals = len(stores[ns].writes)
    await _tick(a, "op-a")
    assert not a.held(ns) and _held_series(ns) is None
    claim = stores[ns].obj
    assert claim is not None and claim["spec"].get("holderIdentity") is None
    assert stores[ns].writes[renewals:] == [("patch", "None")]  # cleared, as on shutdown
    await _tick(a, "op-a")
    assert len(stores[ns].writes) == renewals + 1  # forgotten: nothing more written
    b.want(ns)  # another shard whose round asks takes it at once
    await _tick(b, "op-b")
    assert b.held(ns) and b.epoch(ns, 1) > a.epoch(ns, 1)

    a.want(ns)  # a group appears again: claimed again, its series back
    await _tick(a, "op-a")
    assert not a.held(ns) and a.claimant(ns) == claim_holder(B, "op-b")
    assert _held_series(ns) == 0.0 and _claimed_by_series(ns, claim_holder(B, "op-b")) == 1.0


async def test_a_group_back_within_the_lease_duration_keeps_the_claim() -> None:
    ns = "drop-back"
    stores, clock = {ns: MemoryLeases()}, Clock()
    a = _keeper(A, stores, clock, [])
    a.want(ns)
    await _tick(a, "op-a")
    a.vacated(ns)
    clock.t += T.lease_duration_s - T.retry_period_s
    await _tick(a, "op-a")
    a.want(ns)  # a new group's round
    clock.t += T.retry_period_s
    for _ in range(4):
        await _tick(a, "op-a")
        clock.t += T.retry_period_s
        assert a.held(ns)
    assert [verb for verb, _ in stores[ns].writes] == ["create"] + ["renew"] * 5


async def test_a_namespace_of_the_list_is_kept_without_groups() -> None:
    ns = "drop-listed"
    stores, clock = {ns: MemoryLeases()}, Clock()
    a = _keeper(A, stores, clock, [], ns)
    await _tick(a, "op-a")
    a.vacated(ns)
    clock.t += T.lease_duration_s
    await _tick(a, "op-a")
    assert a.held(ns) and _held_series(ns) == 1.0


async def test_a_namespace_another_shard_holds_is_forgotten_without_a_write() -> None:
    ns = "drop-other"
    stores, clock = {ns: MemoryLeases()}, Clock()
    a = _keeper(A, stores, clock, [], ns)
    b = _keeper(B, stores, clock, [])
    await _tick(a, "op-a1")
    b.want(ns)
    await _tick(b, "op-b")
    assert _claimed_by_series(ns, claim_holder(A, "op-a1")) == 1.0
    clock.t += T.retry_period_s
    await _tick(a, "op-a2")  # A's next leader: one series, the new holder's
    await _tick(b, "op-b")
    assert _claimed_by_series(ns, claim_holder(A, "op-a1")) is None
    assert _claimed_by_series(ns, claim_holder(A, "op-a2")) == 1.0
    b.vacated(ns)
    clock.t += T.lease_duration_s
    writes = list(stores[ns].writes)
    await _tick(a, "op-a2")
    await _tick(b, "op-b")
    assert stores[ns].writes == [*writes, ("renew", claim_holder(A, "op-a2"))]  # A's only
    assert b.claimant(ns) is None and _claimed_by_series(ns, claim_holder(A, "op-a2")) is None
