"""The orders a hand-over round sends its workers (``OrdersPort``, between
``port_facts.FactsPort`` and ``port.KubeGroupPort``): the worker's client, the ACKs kept for
status and peaks, and the overlapped hand-over's three calls (``handover.overlap.OverlapPort``:
a streamed sleep, a wake under a claim limit, the limit's raises). Each order checks first that
this operator still leads, and carries its epoch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from omnistage_operator.decisions.facts import AckFacts, RoomBeside
from omnistage_operator.decisions.handover import WorkerUnavailable
from omnistage_operator.decisions.peaks import StagePeaks
from omnistage_operator.k8s import metrics
from omnistage_operator.k8s.port_facts import FactsPort

if TYPE_CHECKING:
    from omnistage_operator.k8s.port_host import PortHost
    from omnistage_operator.k8s.worker_client import WorkerClient

__all__ = ["OrdersPort"]

log = logging.getLogger(__name__)


class OrdersPort(FactsPort):
    """Orders to one group's workers, for one round."""

    def __init__(self, runner: PortHost, namespace: str, group: str) -> None:
        super().__init__(runner, namespace, group)
        # Since the last observe: the stages sent a Sleep or WakeUp, and their ACKs.
        self._ordered: set[str] = set()
        self._acks: dict[str, AckFacts] = {}

    def _client(self, stage: str) -> WorkerClient:
        pod = self.pods.get(stage)
        client = None if pod is None else self.r.client_for(self.ns, self.specs[stage], pod)
        if client is None:
            raise WorkerUnavailable(f"{stage} has no running pod with an address")
        return client

    def _acked(self, stage: str, ack: AckFacts) -> None:
        """Keep an ACK for status, and count it into the stage's per-device peaks."""
        self._acks[stage] = ack
        key = (self.ns, stage)
        self.r.last_acks[key] = ack
        self.r.peaks[key] = self.r.peaks.get(key, StagePeaks()).acked(ack)

    def _counted(self, op: str, stage: str, task_id: str, ack: AckFacts, took: float) -> None:
        """The ACK of ``op`` (sleep or wake) ``task_id`` arrived after ``took`` seconds:
        logged, counted, kept."""
        metrics.ACK_SECONDS.labels(op).observe(took)
        _log_ack(op, task_id, stage, ack, took)
        self._acked(stage, ack)
        result = "ok" if ack.ok else "not_ok"
        metrics.TRANSITIONS.labels(self.ns, self.group, op, result).inc()
        if op == "sleep" and ack.ok and ack.freed_bytes > 0 and not ack.replayed:
            metrics.BYTES_FREED.labels(self.ns, self.group).inc(ack.freed_bytes)

    async def sleep_stream(
        self, stage: str, level: int, task_id: str, *, timeout_s: float, handoff_channel: str = ""
    ) -> AsyncIterator[int | RoomBeside | AckFacts]:
        """SleepStream of the whole model: the room beside it measured before it began, the
        bytes it has released after each piece, then its ACK (kept for status as a Sleep's)."""
        client = self._client(stage)
        self._ensure_leading(f"SleepStream {task_id}")
        self._ordered.add(stage)
        t0 = time.monotonic()
        stream = client.sleep_stream(
            level,
            task_id,
            timeout_s,
            epoch=self.r.epoch_for(self.ns),
            handoff_channel=handoff_channel,
        )
        async for event in stream:
            if isinstance(event, AckFacts):
                self._counted("sleep", stage, task_id, event, time.monotonic() - t0)
            yield event

    async def wake_limited(
        self, stage: str, task_id: str, claim_limit_bytes: int, handoff_channel: str = ""
    ) -> AckFacts:
        """WakeUp under a claim limit (an overlapped wake), with the contract's deadline."""
        client = self._client(stage)
        self._ensure_leading(f"WakeUp {task_id}")
        self._ordered.add(stage)
        log.info("wake %s: to %s under a claim limit of %d bytes", task_id, stage,
                 claim_limit_bytes)  # fmt: skip
        t0 = time.monotonic()
        ack = await client.wake(
            task_id,
            self.r.settings.wake_timeout_s,
            epoch=self.r.epoch_for(self.ns),
            claim_limit_bytes=max(1, claim_limit_bytes),
            handoff_channel=handoff_channel,
        )
        self._counted("wake", stage, task_id, ack, time.monotonic() - t0)
        return ack

    async def raise_claim_limit(self, stage: str, task_id: str, claim_limit_bytes: int) -> None:
        """RaiseClaimLimit of the overlapped wake ``task_id`` (a status call's deadline)."""
        client = self._client(stage)
        self._ensure_leading(f"RaiseClaimLimit {task_id}")
        running = await client.raise_claim_limit(
            task_id, claim_limit_bytes, self.r.settings.status_timeout_s,
            epoch=self.r.epoch_for(self.ns),
        )  # fmt: skip
        log.debug("%s: claim limit of %s raised to %d (running: %s)", stage, task_id,
                  claim_limit_bytes, running)  # fmt: skip


def _log_ack(op: str, task_id: str, stage: str, ack: AckFacts, took: float) -> None:
    """The ACK's arrival: the call's time and the worker's own (the budget's marks)."""
    verdict = "ok" if ack.ok else "not ok"
    log.info(
        "%s %s of %s: ACK %s in %.3fs (the worker's transition %.3fs)",
        op, task_id, stage, verdict, took, ack.duration_s,
    )  # fmt: skip
