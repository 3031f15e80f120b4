"""The leader elector: one operator replica orders a group's workers at a time.

``Elector`` implements ``leadership.Leadership`` on a ``coordination.k8s.io/v1`` Lease (read and
written through ``lease_store``: acquisitions conditional on the ``resourceVersion``, renewals on
the holder and its epoch, so renewals need no read first and need not wait for each other). The
decisions are ``election``'s pure functions; this module keeps time on the monotonic clock and
reports changes (Events on the Lease, Prometheus metrics, callbacks).

Every replica runs kopf; the handlers of a replica that does not lead only record what they see
(see ``handlers``), and ``GroupRunner`` runs no round and sends no order unless ``leading()``.
``leading()`` turns false by itself when the renew deadline passes, even while a renew request
hangs or the process was stopped, so losing the Lease stops every round at its next check.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import secrets
import socket
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from datetime import UTC, datetime
from typing import Any

import kr8s

from omnistage_operator.decisions.election import (
    Action,
    Observation,
    Tenure,
    Timing,
    decide,
    leading,
    observe,
    parse_record,
    release_patch,
    renew_spec,
    write_for,
)
from omnistage_operator.k8s import metrics
from omnistage_operator.k8s.lease_store import (
    EPOCH_KEY,
    EpochStore,
    KrEpochStore,
    KrLeaseStore,
    LeaseStore,
)

__all__ = [
    "EPOCH_KEY",
    "Elector",
    "EpochStore",
    "KrEpochStore",
    "KrLeaseStore",
    "LeaseStore",
    "new_identity",
]

log = logging.getLogger(__name__)


def new_identity(pod_name: str | None = None) -> str:
    """``<pod name>_<random>``: unique per process, so a restarted pod is a new candidate."""
    base = pod_name or os.environ.get("POD_NAME") or socket.gethostname()
    return f"{base}_{secrets.token_hex(4)}"


EventSink = Callable[[Mapping[str, Any], str, str, bool], Coroutine[Any, Any, None]]


class Elector:
    """Acquires, renews and releases the Lease; ``leading()`` and ``epoch`` for the rounds."""

    def __init__(
        self,
        store: LeaseStore,
        identity: str,
        timing: Timing,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_acquired: Callable[[int], None] | None = None,
        on_lost: Callable[[], None] | None = None,
        event: EventSink | None = None,
        epochs: EpochStore | None = None,
    ) -> None:
        """``epochs``: where the last granted epoch outlives the Lease (None: only the Lease,
        so a re-created Lease starts again at 1)."""
        self.store = store
        self.epochs = epochs
        self._persisted = 0  # the highest epoch this process wrote to ``epochs``
        self.identity = identity
        self.timing = timing
        self._clock = clock
        self._on_acquired = on_acquired
        self._on_lost = on_lost
        self._event = event
        self._obs: Observation | None = None
        self._tenure: Tenure | None = None
        self._lease: dict[str, Any] | None = None
        self._was_leading = False
        self._epoch = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._renewals: set[asyncio.Task[None]] = set()
        metrics.LEADER.set_function(lambda: 1.0 if self.leading() else 0.0)
        metrics.LEADER_EPOCH.set_function(lambda: float(self.epoch))

    # -- Leadership --------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The Lease's transition count when this process acquired it (0 before that)."""
        return self._epoch

    def leading(self) -> bool:
        """Held, and renewed within the renew deadline (monotonic clock)."""
        return leading(self._tenure, self._clock(), self.timing)

    @property
    def holder(self) -> str:
        """The holder this process last saw in the Lease ("" when none)."""
        return self._obs.record.holder if self._obs is not None else ""

    # -- the loop ----------------------------------------------------------------------------

    @property
    def _request_timeout(self) -> float:
        """A read or write of the Lease may take up to the renew deadline (client-go gives its
        election client that timeout): on a loaded machine an API answer can take longer than
        the retry period and than half the deadline (bench/scale at 1000 stages, 2 cores), and
        cutting it shorter loses leadership while the renewal would have landed in time. A
        renewal counts from when it was sent, and the deadline watch reports a loss on time
        whatever a request is doing."""
        return max(self.timing.renew_deadline_s, 1.0)

    async def run(self) -> None:
        """Every retry period until cancelled: the holder sends a renewal (without waiting for
        the earlier ones: each may take up to the renew deadline, so at most about
        ``renew_deadline / retry_period`` are in flight), a candidate tries to acquire."""
        log.info(
            "leader election on lease %s/%s as %s (lease %ss, renew deadline %ss, retry %ss)",
            getattr(self.store, "namespace", "?"), getattr(self.store, "name", "?"),
            self.identity, self.timing.lease_duration_s, self.timing.renew_deadline_s,
            self.timing.retry_period_s,
        )  # fmt: skip
        try:
            while True:
                if self._tenure is not None:
                    task = asyncio.create_task(self._renewal())
                    self._renewals.add(task)
                    task.add_done_callback(self._renewals.discard)
                else:
                    await self._try(self.step())
                self._notice()
                delay = self.timing.retry_period_s
                if not self.leading():
                    delay *= random.uniform(1.0, 1.2)  # candidates do not all try at once
                await asyncio.sleep(delay)
        finally:
            for task in list(self._renewals):
                task.cancel()

    async def _try(self, attempt: Awaitable[Any]) -> None:
        try:
            await attempt
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # an API error: leading() runs out by itself
            log.warning("leader election: %r (leading: %s)", exc, self.leading())

    async def _renewal(self) -> None:
        await self._try(self.renew())
        self._notice()

    async def _call(self, coro: Awaitable[dict[str, Any] | None]) -> dict[str, Any] | None:
        return await asyncio.wait_for(coro, self._request_timeout)

    @staticmethod
    async def _call_for(
        coro: Awaitable[dict[str, Any] | None], timeout_s: float
    ) -> dict[str, Any] | None:
        return await asyncio.wait_for(coro, timeout_s)

    async def _call_int(self, coro: Awaitable[int]) -> int:
        return await asyncio.wait_for(coro, self._request_timeout)

    async def _call_none(self, coro: Awaitable[None]) -> None:
        await asyncio.wait_for(coro, self._request_timeout)

    async def renew(self) -> bool:
        """The holder's renewal, without reading the Lease first: False when the Lease no longer
        names this process with its epoch (then it no longer holds it). A late answer counts
        from when its request was sent, and only while this process still holds that epoch."""
        tenure = self._tenure
        if tenure is None:
            return False
        spec = renew_spec(self.identity, datetime.now(UTC), self.timing)
        sent = self._clock()
        written = await self._call(self.store.renew(self.identity, tenure.epoch, spec))
        current = self._tenure
        if current is None or current.epoch != tenure.epoch:
            return False
        if written is None:
            log.warning("lease no longer held with epoch %s: reading it again", tenure.epoch)
            self._tenure = None
            return False
        if sent > current.renewed_at:
            self._tenure = Tenure(tenure.epoch, sent)
            self._lease = written
            self._obs = observe(self._obs, parse_record(written), self._clock())
        return True

    async def step(self) -> None:
        """One try: the holder renews; a candidate (or a holder whose renewal was refused) reads
        the Lease, then creates, renews or takes it over when ``decide`` says so."""
        if self._tenure is not None and await self.renew():
            return
        raw = await self._call(self.store.get())
        # Seen when the answer arrived: never earlier than the holder's write it shows.
        self._obs = observe(self._obs, parse_record(raw) if raw else None, self._clock())
        if raw is not None:
            self._lease = raw
        action = decide(self.identity, self._obs, self._clock(), self.timing)
        if action is Action.WAIT:
            if self._tenure is not None:
                log.warning("lease taken over by %s", self.holder)
            self._tenure = None
            return
        record = self._obs.record if self._obs is not None else None
        floor = 0
        if action is not Action.RENEW and self.epochs is not None:
            floor = await self._call_int(self.epochs.get())
        spec, epoch = write_for(
            action, self.identity, record, datetime.now(UTC), self.timing, floor=floor
        )
        sent = self._clock()
        if action is Action.CREATE:
            written = await self._call(self.store.create(spec))
        else:
            assert record is not None
            written = await self._call(self.store.patch(record.resource_version, spec))
        if written is None:  # another replica wrote first: read again next time
            if action is not Action.RENEW:
                return
            self._tenure = None
            return
        self._lease = written
        self._obs = observe(self._obs, parse_record(written), self._clock())
        if self.epochs is not None and epoch > self._persisted:
            # Durable before the first order carries it (a failure: not leading, and the
            # next renew tries again).
            await self._call_none(self.epochs.put(epoch))
            self._persisted = epoch
        self._tenure = Tenure(epoch, sent)
        self._epoch = epoch

    def _notice(self) -> None:
        """Report a change of leadership (metrics, Event, callbacks) once."""
        now_leading = self.leading()
        if now_leading == self._was_leading:
            return
        self._was_leading = now_leading
        if now_leading:
            metrics.LEADER_TRANSITIONS.labels("acquired").inc()
            msg = f"{self.identity} leads with epoch {self.epoch}"
            log.info("leadership acquired: %s", msg)
            self._emit("LeaderElected", msg, warning=False)
            if self._on_acquired is not None:
                self._on_acquired(self.epoch)
        else:
            metrics.LEADER_TRANSITIONS.labels("lost").inc()
            msg = f"{self.identity} stopped leading (epoch {self.epoch}); holder now: "
            msg += self.holder or "none"
            log.warning("leadership lost: %s", msg)
            self._emit("LeaderLost", msg, warning=True)
            if self._on_lost is not None:
                self._on_lost()

    def _emit(self, reason: str, message: str, *, warning: bool) -> None:
        if self._event is None or self._lease is None:
            return
        task: asyncio.Task[None] = asyncio.create_task(
            self._event(self._lease, reason, message, warning)
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def watch_deadline(self) -> None:
        """Report a loss as soon as the renew deadline passes, even while a renew hangs."""
        while True:
            await asyncio.sleep(min(0.1, self.timing.retry_period_s / 4))
            if self._was_leading and not self.leading():
                self._notice()

    async def release(self) -> None:
        """Step down (shutdown): stop leading now, then clear the holder so a standby takes over
        at its next try. Best effort: a Lease not released simply expires."""
        held = self._tenure is not None
        self._tenure = None
        self._notice()
        if not held or self._obs is None:
            return
        try:
            raw = await self._call_for(self.store.get(), self.timing.renew_deadline_s / 2)
            if raw is None or parse_record(raw).holder != self.identity:
                return
            version = parse_record(raw).resource_version
            done = await self._call_for(
                self.store.patch(version, release_patch(datetime.now(UTC))),
                self.timing.renew_deadline_s / 2,
            )
            if done is not None:
                log.info("lease released by %s", self.identity)
        except (TimeoutError, kr8s.ServerError, OSError) as exc:
            log.warning("lease not released: %s", exc)
