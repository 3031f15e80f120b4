"""The elector's loop against an in-memory Lease with the API server's concurrency rules.

``MemoryLeases`` behaves as the API server does for one Lease: every write bumps the
``resourceVersion``, a patch carrying an older one is refused (409 -> None), a renewal whose
holder or transitions no longer match is refused (a JSON patch's failed test, 422 -> None), a
create of an existing Lease is refused, and a call can be made to hang (a partition). Time is a fake
monotonic clock the test advances.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import pytest

from omnistage_operator.decisions.election import Timing
from omnistage_operator.k8s import metrics
from omnistage_operator.k8s.leader import Elector

T = Timing(lease_duration_s=3, renew_deadline_s=2, retry_period_s=0.5)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class MemoryLeases:
    """One Lease, with resourceVersion preconditions; ``cut`` makes every call hang."""

    def __init__(self) -> None:
        self.obj: dict[str, Any] | None = None
        self.rv = 0
        self.cut = False
        self.delay_s = 0.0  # a slow API server: every answer takes this long (real time)
        self.restored = asyncio.Event()
        self.writes: list[tuple[str, str]] = []  # (verb, holder)

    async def _net(self) -> None:
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.cut:
            await self.restored.wait()  # a blackholed connection: no answer, no error

    def _bump(self, spec: Mapping[str, Any]) -> dict[str, Any]:
        self.rv += 1
        meta = {"name": "lease", "namespace": "ns", "resourceVersion": str(self.rv), "uid": "u"}
        old = (self.obj or {}).get("spec", {})
        merged = {k: v for k, v in {**old, **spec}.items() if v is not None}
        self.obj = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta}
        self.obj["spec"] = merged
        return dict(self.obj)

    def delete(self) -> None:
        """The Lease is deleted (by hand, or with its namespace)."""
        self.obj = None

    async def get(self) -> dict[str, Any] | None:
        await self._net()
        return None if self.obj is None else dict(self.obj)

    async def create(self, spec: Mapping[str, Any]) -> dict[str, Any] | None:
        await self._net()
        if self.obj is not None:
            return None
        self.writes.append(("create", str(spec.get("holderIdentity"))))
        return self._bump(spec)

    async def patch(self, resource_version: str, spec: Mapping[str, Any]) -> dict[str, Any] | None:
        await self._net()
        if self.obj is None or self.obj["metadata"]["resourceVersion"] != resource_version:
            return None
        self.writes.append(("patch", str(spec.get("holderIdentity"))))
        return self._bump(spec)

    async def renew(
        self, holder: str, transitions: int, spec: Mapping[str, Any]
    ) -> dict[str, Any] | None:
        await self._net()
        if self.obj is None:
            return None
        now = self.obj["spec"]
        if now.get("holderIdentity") != holder or now.get("leaseTransitions") != transitions:
            return None  # a JSON patch's failed test: 422
        self.writes.append(("renew", holder))
        return self._bump(spec)


class MemoryEpochs:
    """The ConfigMap that keeps the last epoch; ``broken`` makes writes fail."""

    def __init__(self) -> None:
        self.epoch = 0
        self.broken = False

    async def get(self) -> int:
        return self.epoch

    async def put(self, epoch: int) -> None:
        if self.broken:
            raise RuntimeError("configmaps is forbidden")
        self.epoch = max(self.epoch, epoch)


def _elector(store: MemoryLeases, name: str, clock: Clock, **kw: Any) -> Elector:
    return Elector(store, name, T, clock=clock, **kw)


async def test_first_candidate_creates_with_epoch_one_and_renews() -> None:
    store, clock = MemoryLeases(), Clock()
    acquired: list[int] = []
    a = _elector(store, "a", clock, on_acquired=acquired.append)
    assert not a.leading() and a.epoch == 0
    await a.step()
    a._notice()
    assert a.leading() and a.epoch == 1 and acquired == [1]
    assert store.obj is not None and store.obj["spec"]["holderIdentity"] == "a"
    clock.t += 1.5
    await a.step()
    assert a.leading() and a.epoch == 1
    assert store.obj["spec"]["leaseTransitions"] == 1
    assert [w[0] for w in store.writes] == ["create", "renew"]


async def test_a_deleted_lease_is_created_again_above_the_last_epoch() -> None:
    """Deleting the Lease does not send the epoch back to 1: workers that obeyed epoch 2
    would refuse every order of the new leader (and a stale one could sneak in)."""
    store, clock, epochs = MemoryLeases(), Clock(), MemoryEpochs()
    a = _elector(store, "a", clock, epochs=epochs)
    await a.step()
    b = _elector(store, "b", clock, epochs=epochs)
    await a.release()
    await b.step()
    assert b.leading() and b.epoch == 2 and epochs.epoch == 2
    store.delete()  # kubectl delete lease
    c = _elector(store, "c", clock, epochs=epochs)
    clock.t += 10  # b's lease ran out meanwhile
    await c.step()
    assert c.leading() and c.epoch == 3 and store.obj is not None
    assert store.obj["spec"]["leaseTransitions"] == 3 and epochs.epoch == 3


async def test_an_epoch_not_persisted_is_not_led_with() -> None:
    """The epoch is written outside the Lease before any order carries it; until then the
    holder does not lead (the next renew writes it again)."""
    store, clock, epochs = MemoryLeases(), Clock(), MemoryEpochs()
    epochs.broken = True
    a = _elector(store, "a", clock, epochs=epochs)
    with pytest.raises(RuntimeError):
        await a.step()
    assert not a.leading() and store.obj is not None  # the Lease names a, all the same
    epochs.broken = False
    clock.t += 0.5
    await a.step()
    assert a.leading() and a.epoch == 1 and epochs.epoch == 1


async def test_standby_waits_a_full_lease_duration_after_the_last_renew() -> None:
    store, clock = MemoryLeases(), Clock()
    a, b = _elector(store, "a", clock), _elector(store, "b", clock)
    await a.step()
    await b.step()
    assert not b.leading() and b.holder == "a"
    # a stops renewing (stopped process). b takes over only once the record was unchanged
    # for the lease duration by b's clock, and by then a has long stopped leading.
    clock.t += T.renew_deadline_s
    assert not a.leading()
    await b.step()
    assert not b.leading()
    clock.t += T.lease_duration_s - T.renew_deadline_s - 0.01
    await b.step()
    assert not b.leading()
    clock.t += 0.01
    await b.step()
    assert b.leading() and b.epoch == 2
    # a comes back: it sees b holding and stays a standby, with its stale epoch.
    await a.step()
    assert not a.leading() and a.holder == "b"


async def test_a_renewing_holder_is_never_taken_over() -> None:
    store, clock = MemoryLeases(), Clock()
    a, b = _elector(store, "a", clock), _elector(store, "b", clock)
    await a.step()
    for _ in range(40):
        clock.t += T.retry_period_s
        await b.step()
        await a.step()
        assert a.leading() and not b.leading()
    assert {h for _, h in store.writes} == {"a"}


async def test_two_candidates_racing_for_a_free_lease_one_wins() -> None:
    store, clock = MemoryLeases(), Clock()
    a, b = _elector(store, "a", clock), _elector(store, "b", clock)
    await a.step()
    await a.release()
    assert store.obj is not None and "holderIdentity" not in store.obj["spec"]
    c = _elector(store, "c", clock)
    # b and c both read the free Lease, then both write with the same resourceVersion.
    await asyncio.gather(b.step(), c.step())
    assert [b.leading(), c.leading()].count(True) == 1
    winner = b if b.leading() else c
    assert winner.epoch == 2


async def test_a_renewal_that_finds_another_holder_drops_leadership_at_once() -> None:
    store, clock = MemoryLeases(), Clock()
    a = _elector(store, "a", clock)
    await a.step()
    assert a.leading()
    store._bump({"holderIdentity": "intruder", "leaseTransitions": 2})  # written by another
    await a.step()
    assert not a.leading() and a.holder == "intruder"
    assert [w[0] for w in store.writes] == ["create"]  # the renewal was refused


async def test_a_renewal_of_a_lease_taken_over_and_back_is_refused() -> None:
    """Holder and epoch both must match: the same holder at a later epoch (it lost the Lease
    and took it again) is not the tenure the renewal was for."""
    store, clock = MemoryLeases(), Clock()
    a = _elector(store, "a", clock)
    await a.step()
    store._bump({"holderIdentity": "a", "leaseTransitions": 3})
    assert not await a.renew()
    assert not a.leading()


async def test_renewals_do_not_wait_for_slow_answers() -> None:
    """An API server answering each renewal later than half the renew deadline: one renewal
    at a time (or each cut at half the deadline) cannot keep the Lease, renewals sent every
    retry period, each allowed up to the deadline, keep it without a gap (real time)."""
    timing = Timing(lease_duration_s=3, renew_deadline_s=2, retry_period_s=0.25)
    store = MemoryLeases()
    lost: list[bool] = []
    a = Elector(store, "a", timing, on_lost=lambda: lost.append(True))
    run = asyncio.create_task(a.run())
    watch = asyncio.create_task(a.watch_deadline())
    try:
        for _ in range(100):
            if a.leading():
                break
            await asyncio.sleep(0.02)
        assert a.leading()
        store.delay_s = 1.2  # > renew deadline / 2, and 2 x 1.2 + 0.25 > 2
        for _ in range(int(4 * timing.renew_deadline_s / 0.05)):
            await asyncio.sleep(0.05)
            assert a.leading() and not lost
        assert sum(w[0] == "renew" for w in store.writes) >= 10
    finally:
        for task in (run, watch):
            task.cancel()
        await asyncio.gather(run, watch, return_exceptions=True)


async def test_leadership_runs_out_while_a_renew_hangs() -> None:
    store, clock = MemoryLeases(), Clock()
    lost: list[bool] = []
    a = _elector(store, "a", clock, on_lost=lambda: lost.append(True))
    await a.step()
    a._notice()
    store.cut = True
    step = asyncio.create_task(a.step())
    await asyncio.sleep(0.01)
    clock.t += T.renew_deadline_s
    assert not a.leading()  # nothing answered: the deadline alone decides
    watch = asyncio.create_task(a.watch_deadline())
    for _ in range(50):
        if lost:
            break
        await asyncio.sleep(0.02)
    assert lost == [True]
    for task in (step, watch):
        task.cancel()
    await asyncio.gather(step, watch, return_exceptions=True)


async def test_answers_slower_than_the_retry_period_still_acquire() -> None:
    # A loaded API server: each answer takes longer than the retry period (and than 1 s) but
    # less than half the renew deadline; cutting each call at the retry period never led.
    store, clock = MemoryLeases(), Clock()
    slow = Timing(lease_duration_s=6, renew_deadline_s=4, retry_period_s=1)
    a = Elector(store, "a", slow, clock=clock)
    store.delay_s = 1.3
    await a.step()
    assert a.leading() and store.writes == [("create", "a")]


async def test_holder_that_missed_its_deadline_renews_its_unchanged_record() -> None:
    store, clock = MemoryLeases(), Clock()
    a = _elector(store, "a", clock)
    await a.step()
    clock.t += T.renew_deadline_s + 0.5
    assert not a.leading()
    await a.step()
    assert a.leading() and a.epoch == 1  # nobody held it in between: same epoch


async def test_metrics_follow_leadership() -> None:
    store, clock = MemoryLeases(), Clock()
    a = _elector(store, "a", clock)
    before = metrics.LEADER_TRANSITIONS.labels("acquired")._value.get()
    await a.step()
    a._notice()
    assert _gauge("omnistage_leader") == 1.0
    assert _gauge("omnistage_leader_epoch") == 1.0
    assert metrics.LEADER_TRANSITIONS.labels("acquired")._value.get() == before + 1
    clock.t += T.renew_deadline_s
    assert _gauge("omnistage_leader") == 0.0


def _gauge(name: str) -> float:
    from prometheus_client import REGISTRY

    value = REGISTRY.get_sample_value(name)
    assert value is not None
    return float(value)


async def test_events_name_the_holder() -> None:
    store, clock = MemoryLeases(), Clock()
    events: list[tuple[str, str, bool]] = []

    async def sink(lease: Mapping[str, Any], reason: str, message: str, warning: bool) -> None:
        assert lease["kind"] == "Lease"
        events.append((reason, message, warning))

    a = _elector(store, "pod-a_1234", clock, event=sink)
    await a.step()
    a._notice()
    clock.t += T.renew_deadline_s
    a._notice()
    await asyncio.sleep(0)
    assert [(r, w) for r, _, w in events] == [("LeaderElected", False), ("LeaderLost", True)]
    assert "pod-a_1234" in events[0][1] and "epoch 1" in events[0][1]


@pytest.mark.parametrize("seed", range(5))
async def test_random_schedules_never_have_two_leaders(seed: int) -> None:
    """Three candidates stepping in random order with random stalls (a stopped process does
    not step): at no instant do two of them lead."""
    import random

    rng = random.Random(seed)
    store, clock = MemoryLeases(), Clock()
    electors = [_elector(store, n, clock) for n in "abc"]
    stalled = {e.identity: 0.0 for e in electors}
    epochs: list[int] = []
    for _ in range(600):
        clock.t += rng.uniform(0.05, 0.4)
        for e in rng.sample(electors, len(electors)):
            if stalled[e.identity] > clock.t:
                continue
            if rng.random() < 0.03:
                stalled[e.identity] = clock.t + rng.uniform(0.5, 6)
                continue
            await e.step()
        leaders = [e for e in electors if e.leading()]
        assert len(leaders) <= 1, [(e.identity, e.epoch) for e in leaders]
        if leaders and (not epochs or epochs[-1] != leaders[0].epoch):
            epochs.append(leaders[0].epoch)
    assert epochs == sorted(epochs) and len(epochs) > 1
