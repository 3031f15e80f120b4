"""Namespace claims between shards: the I/O (``ClaimKeeper``), on the election's thread.

Every retry period, while this replica leads its shard, the keeper writes the claim of every
namespace the shard serves (``decisions.namespace_claims``: a Lease ``omnistage-namespace-claim``
in that namespace naming the shard and its leader): a held claim is renewed by a JSON patch
conditional on its holder and transition count (no read first, as the election's renewals), a
claim not held is read and then created, taken back (this shard's, written by another of its
replicas) or taken over (free, or expired on this replica's clock), each conditional on what was
read. So a shard adds one request per served namespace per retry period, whatever the number of
groups, and rounds read the outcome from memory (``held``, ``claimant``).

The namespaces come from ``--namespace`` (literal names, claimed from the start and kept while
the process runs) and from the rounds (``want``: in cluster-wide mode, or under a pattern, a
namespace is claimed once a group of it has a round). A namespace the rounds asked for that has
had no group for a lease duration (``vacated`` by the runner when its last group is dropped;
``decisions.namespace_claims.claim_dropped``) is dropped at the next retry period: its holder
cleared as on shutdown (conditional on this shard's last write), its state and series
(``omnistage_namespace_claim_held``, ``omnistage_namespace_claimed_by_other_shard``) forgotten;
a round that wants it again claims it again. ``on_change(namespace)`` is called on this thread
whenever the claim turns held or another shard's holder is seen (the caller hands it to the
operator's loop, which kicks that namespace's groups).
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from collections.abc import Callable, Coroutine, Iterable
from datetime import UTC, datetime
from typing import Any, Protocol

from omnistage_operator.decisions.election import (
    Action,
    Observation,
    Tenure,
    Timing,
    observe,
    parse_record,
    release_patch,
    renew_spec,
)
from omnistage_operator.decisions.namespace_claims import (
    ClaimState,
    claim_dropped,
    claim_holder,
    claim_write,
    decide_claim,
    holds,
    order_epoch,
)
from omnistage_operator.k8s import metrics
from omnistage_operator.k8s.lease_store import LeaseStore

__all__ = ["ClaimKeeper", "Leader"]

log = logging.getLogger(__name__)

_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")  # a namespace name, not a pattern


class Leader(Protocol):
    """The shard's elector as the keeper sees it."""

    identity: str

    def leading(self) -> bool:
        """True while this replica leads its shard."""
        ...


class ClaimKeeper:
    """Claims the shard's namespaces while its replica leads; ``held``/``claimant`` for rounds."""

    def __init__(
        self,
        timing: Timing,
        namespaces: Iterable[str] = (),
        *,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[str], None] | None = None,
    ) -> None:
        """``namespaces``: claimed from the start (literal names; patterns are skipped: their
        namespaces are claimed as their groups' rounds ``want`` them)."""
        self.shard = ""
        self.timing = timing
        self._store_for: Callable[[str], LeaseStore] | None = None
        self._stores: dict[str, LeaseStore] = {}
        self._clock = clock
        self._on_change = on_change
        self._lock = threading.Lock()
        self._wanted: set[str] = set()
        self._listed: set[str] = set()  # literal names of the list: never dropped
        self._vacated: dict[str, float] = {}  # namespace -> when its last group was dropped
        self._states: dict[str, ClaimState] = {}
        self._claimants: dict[str, str] = {}  # namespace -> the other shard's holder seen
        self._in_flight: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        for namespace in namespaces:
            if _NAME.match(namespace):
                self._listed.add(namespace)
                self.want(namespace)

    def bind(self, shard: str, store_for: Callable[[str], LeaseStore]) -> None:
        """The shard's name (``<lease namespace>/<lease name>``) and its claims' stores (made
        on the election's thread, with its API client); nothing is claimed before."""
        self.shard = shard
        self._store_for = store_for

    # -- what rounds read (any thread) -------------------------------------------------------

    def want(self, namespace: str) -> None:
        """Claim ``namespace`` from the next retry period on (idempotent, cheap); a claim
        ``vacated`` but not dropped yet is kept."""
        if namespace in self._wanted and namespace not in self._vacated:
            return
        with self._lock:  # its series with it: a drop on the other thread removes both
            self._vacated.pop(namespace, None)
            if namespace in self._wanted:
                return
            self._wanted.add(namespace)
            metrics.NAMESPACE_CLAIM_HELD.labels(namespace).set_function(
                lambda: 1.0 if self.held(namespace) else 0.0
            )

    def vacated(self, namespace: str) -> None:
        """No group of ``namespace`` is left: drop its claim a lease duration from now unless
        a round ``want``s it again (a literal name of the list is kept)."""
        with self._lock:
            if namespace in self._wanted and namespace not in self._listed:
                self._vacated.setdefault(namespace, self._clock())

    def held(self, namespace: str) -> bool:
        """This shard holds the namespace's claim (written within the renew deadline)."""
        return holds(self._states.get(namespace), self._clock(), self.timing)

    def claimant(self, namespace: str) -> str | None:
        """The other shard's holder this shard last found on the claim (None: none)."""
        return self._claimants.get(namespace)

    def epoch(self, namespace: str, shard_epoch: int) -> int:
        """The epoch orders carry in ``namespace``: the shard's, above it the claim's
        transitions (``order_epoch``; only meaningful while the claim is held)."""
        state = self._states.get(namespace)
        held = state.tenure.epoch if state is not None and state.tenure is not None else 1
        return order_epoch(held, shard_epoch)

    # -- the loop (the election's thread) ----------------------------------------------------

    async def run(self, leader: Leader) -> None:
        """Every retry period until cancelled: while ``leader`` leads, write each wanted
        namespace's claim (a namespace whose last write is still in flight is skipped). A
        replica that starts leading claims within a tenth of a second, not a retry period."""
        try:
            while True:
                if leader.leading() and self._store_for is not None:
                    self.tick(leader.identity)
                    await asyncio.sleep(self.timing.retry_period_s)
                else:
                    await asyncio.sleep(min(0.1, self.timing.retry_period_s / 4))
        finally:
            for task in list(self._tasks):
                task.cancel()

    async def release(self) -> None:
        """Shutdown: stop holding every claim now, then clear each one's holder (conditional on
        the version this shard last wrote) so another shard may take it at its next try, as
        the election's own Lease is released. The transitions stay: a later holder's orders
        still rank above this shard's. Best effort: a claim not released expires."""
        held = {ns: st.obs for ns, st in self._states.items() if st.tenure is not None and st.obs}
        for namespace, obs in held.items():
            self._states[namespace] = ClaimState(obs, None)
        await asyncio.gather(
            *(self._clear(ns, self._store(ns), o.record.resource_version) for ns, o in held.items())
        )

    async def _clear(self, namespace: str, store: LeaseStore, version: str) -> None:
        """Clear the claim's holder, conditional on ``version`` (this shard's last write)."""
        patch = store.patch(version, release_patch(datetime.now(UTC)))
        try:
            done = await asyncio.wait_for(patch, self.timing.renew_deadline_s / 2)
        except Exception as exc:  # an API error or a timeout: the claim expires instead
            log.warning("namespace claim %s not released: %r", namespace, exc)
            return
        if done is not None:
            log.info("namespace claim %s released by shard %s", namespace, self.shard)

    def tick(self, leader: str) -> list[asyncio.Task[None]]:
        """Drop the claims of namespaces left without a group for a lease duration, then start
        one write (or read and write) of every wanted namespace's claim."""
        now = self._clock()
        with self._lock:
            dropped = [
                (ns, *self._forget(ns))
                for ns, since in list(self._vacated.items())
                if ns not in self._in_flight and claim_dropped(since, now, self.timing)
            ]
            wanted = sorted(self._wanted - self._in_flight)
        started = []
        for namespace, state, store in dropped:
            log.info("namespace %s has no group left: its claim dropped", namespace)
            if state is not None and state.tenure is not None and state.obs and store:
                version = state.obs.record.resource_version
                started.append(self._start(namespace, self._clear(namespace, store, version)))
        holder = claim_holder(self.shard, leader)
        started += [self._start(ns, self._claim(ns, holder)) for ns in wanted]
        return started

    def _forget(self, namespace: str) -> tuple[ClaimState | None, LeaseStore | None]:
        """Forget a dropped namespace's claim (under the lock): not wanted, not held, its
        series removed; its state and store, to clear the holder with."""
        self._wanted.discard(namespace)
        del self._vacated[namespace]
        state = self._states.pop(namespace, None)
        claimant = self._claimants.pop(namespace, None)
        metrics.NAMESPACE_CLAIM_HELD.remove(namespace)
        if claimant is not None:
            metrics.NAMESPACE_CLAIMED_BY.remove(namespace, claimant)
        return state, self._stores.pop(namespace, None)

    def _start(self, namespace: str, write: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run one write of the namespace's claim (no other starts until it ended)."""
        self._in_flight.add(namespace)
        task = asyncio.create_task(write)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda _: self._in_flight.discard(namespace))
        return task

    async def _claim(self, namespace: str, holder: str) -> None:
        before = self.held(namespace), self._claimants.get(namespace)
        try:
            await asyncio.wait_for(self._step(namespace, holder), self.timing.renew_deadline_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # an API error or a timeout: the claim lapses by itself
            log.warning("namespace claim %s: %r (held: %s)", namespace, exc, self.held(namespace))
        after = self.held(namespace), self._claimants.get(namespace)
        if after != before:
            self._changed(namespace, before[1], after)

    def _changed(self, namespace: str, was: str | None, now: tuple[bool, str | None]) -> None:
        held, claimant = now
        if was is not None and was != claimant:  # one series per namespace at most
            metrics.NAMESPACE_CLAIMED_BY.remove(namespace, was)
        if claimant is not None:
            metrics.NAMESPACE_CLAIMED_BY.labels(namespace, claimant).set(1)
            log.warning("namespace %s is claimed by another shard: %s", namespace, claimant)
        if held:
            log.info("namespace %s claimed by shard %s", namespace, self.shard)
        if self._on_change is not None and (held or claimant is not None):
            self._on_change(namespace)

    def _store(self, namespace: str) -> LeaseStore:
        store = self._stores.get(namespace)
        if store is None:
            assert self._store_for is not None
            store = self._stores[namespace] = self._store_for(namespace)
        return store

    async def _step(self, namespace: str, holder: str) -> None:
        state = self._states.get(namespace, ClaimState())
        store = self._store(namespace)
        tenure = state.tenure
        if tenure is not None:  # renew without reading, conditional on holder and transitions
            spec = renew_spec(holder, datetime.now(UTC), self.timing)
            sent = self._clock()
            written = await store.renew(holder, tenure.epoch, spec)
            if written is not None:
                self._wrote(namespace, written, tenure.epoch, sent)
                return
            log.warning("namespace claim %s no longer ours: reading it again", namespace)
            state = ClaimState(state.obs, None)
            self._states[namespace] = state
        raw = await store.get()
        obs = observe(state.obs, parse_record(raw) if raw else None, self._clock())
        action = decide_claim(self.shard, obs, self._clock(), self.timing)
        if action is Action.WAIT:
            assert obs is not None
            self._states[namespace] = ClaimState(obs, None)
            self._claimants[namespace] = obs.record.holder
            return
        spec, transitions = claim_write(action, holder, obs, datetime.now(UTC), self.timing)
        sent = self._clock()
        if action is Action.CREATE:
            written = await store.create(spec)
        else:
            assert obs is not None
            written = await store.patch(obs.record.resource_version, spec)
        if written is None:  # another writer came first: read again next period
            self._states[namespace] = ClaimState(obs, None)
            return
        self._wrote(namespace, written, transitions, sent)

    def _wrote(self, namespace: str, written: dict[str, Any], epoch: int, sent: float) -> None:
        prev = self._states.get(namespace, ClaimState())
        obs: Observation | None = observe(prev.obs, parse_record(written), self._clock())
        renewed = sent
        if prev.tenure is not None and prev.tenure.epoch == epoch:
            renewed = max(sent, prev.tenure.renewed_at)  # a late answer never moves it back
        self._states[namespace] = ClaimState(obs, Tenure(epoch, renewed))
        self._claimants.pop(namespace, None)
