"""A group's rounds wait while another shard holds its namespace's claim (``ClaimGate``, mixed
into ``runner.GroupRunner``).

Before a round orders anything, the gate asks the shard's claims (read from memory: the
``ClaimKeeper`` writes them on the election's thread, once per namespace per retry period):

- held by this shard: the round runs; a wait this shard wrote on the group's stages before
  (``status.namespaceClaim`` naming this shard) is cleared. Under a claim taken since this
  shard last ordered there (its epoch there changed), what it last wrote and read in the
  namespace is forgotten first (another shard may have acted meanwhile).
- held by another shard: no round (nothing is ordered, created or deleted there); once per
  stage and holder, the stage's ``status.namespaceClaim`` says so (reason
  ``NamespaceClaimed``, the other shard, the message), with a Warning Event per stage and a log
  line; every round skipped counts in ``omnistage_rounds_total{outcome="namespace_claimed"}``.
  A write the API refused (and its Event) is tried again at the next round, as is a clear.
  The keeper kicks the namespace's groups once the claim is this shard's.
- not held, and no other shard's holder seen (not written yet, or this shard's claim lapsed):
  no round (``outcome="claim_pending"``); the keeper kicks the groups once it holds it.

``status.namespaceClaim`` is a field of its own, not a condition: the shard that holds the
claim writes the stage's conditions (every write sets the whole list from what it last wrote),
so a condition written by the waiting shard would be erased by the next write of the other.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from omnistage_operator.decisions.leadership import NamespaceClaims
from omnistage_operator.decisions.namespace_claims import shard_of, wait_message
from omnistage_operator.k8s import metrics
from omnistage_operator.k8s.kube import OMNISTAGE, Kube, KubeError
from omnistage_operator.k8s.views import GroupViews

__all__ = ["CLAIM_REASON", "ClaimGate"]

log = logging.getLogger(__name__)

CLAIM_REASON = "NamespaceClaimed"
GroupKey = tuple[str, str]
StageKey = tuple[str, str]


class ClaimGate:
    """The claim half of ``GroupRunner`` (the attributes below are the runner's)."""

    kube: Kube
    views: GroupViews
    claims: NamespaceClaims
    claim_waits: dict[StageKey, str]  # stage -> the holder its status was told of
    claim_epochs: dict[str, int]  # namespace -> the epoch this shard last ordered there with
    published: dict[tuple[str, str], dict[str, Any]]
    kept: dict[GroupKey, Any]

    if TYPE_CHECKING:

        def emit(
            self, body: Mapping[str, Any], reason: str, message: str, *, warning: bool = False
        ) -> None: ...

        def epoch_for(self, namespace: str) -> int: ...

    async def claim_gate(self, namespace: str, group: str) -> bool:
        """True when this shard may order the group's workers now (see the module)."""
        claims = self.claims
        claims.want(namespace)
        if claims.held(namespace):
            self._forget_other_shards(namespace)
            await self._clear_waits(namespace, group, claims.shard)
            return True
        holder = claims.claimant(namespace)
        outcome = "claim_pending" if holder is None else "namespace_claimed"
        metrics.ROUNDS.labels(namespace, group, outcome).inc()
        if holder is None:
            log.debug("group %s/%s: namespace claim not held yet, no round", namespace, group)
            return False
        bodies = [
            b
            for b in self.views.stages(namespace, group)
            if self.claim_waits.get((namespace, b["metadata"]["name"])) != holder
        ]
        if not bodies:
            return False
        message = wait_message(namespace, claims.shard, holder)
        log.warning("group %s/%s waits: %s", namespace, group, message)
        wait = {
            "reason": CLAIM_REASON,
            "shard": claims.shard,
            "claimedBy": shard_of(holder),
            "holder": holder,
            "message": message,
        }
        written = await asyncio.gather(*(self._write(namespace, b, wait) for b in bodies))
        for body, done in zip(bodies, written, strict=True):
            if done:  # one the API refused is told at the next round
                self.claim_waits[(namespace, body["metadata"]["name"])] = holder
                self.emit(body, CLAIM_REASON, message, warning=True)
        return False

    def _forget_other_shards(self, namespace: str) -> None:
        epoch = self.epoch_for(namespace)
        before = self.claim_epochs.get(namespace)
        self.claim_epochs[namespace] = epoch
        if before is None or before == epoch:
            return
        for key in [k for k in self.published if k[0] == namespace]:
            del self.published[key]
        for gkey in [k for k in self.kept if k[0] == namespace]:
            del self.kept[gkey]

    async def _clear_waits(self, namespace: str, group: str, shard: str) -> None:
        """Clear ``status.namespaceClaim`` where this shard wrote it (an in-memory look at the
        group's stages; a write only where one is found). What this shard told a stage is
        forgotten once the clear is written: one the API refused is tried again next round,
        even before the watch shows the wait."""
        stale = []
        for body in self.views.stages(namespace, group):
            told = (namespace, body["metadata"]["name"]) in self.claim_waits
            wait = (body.get("status") or {}).get("namespaceClaim") or {}
            if told or wait.get("shard") == shard:
                stale.append(body)
        cleared = await asyncio.gather(*(self._write(namespace, b, None) for b in stale))
        for body, done in zip(stale, cleared, strict=True):
            if done:
                self.claim_waits.pop((namespace, body["metadata"]["name"]), None)

    async def _write(
        self, namespace: str, body: Mapping[str, Any], wait: Mapping[str, Any] | None
    ) -> bool:
        """Write (or clear) the stage's ``status.namespaceClaim``; False when the API refused
        (a stage gone counts as written: nothing is left to tell)."""
        name = body["metadata"]["name"]
        patch = {"status": {"namespaceClaim": dict(wait) if wait is not None else None}}
        try:
            await self.kube.merge_patch(OMNISTAGE, namespace, name, patch, status=True)
        except KubeError as exc:
            log.warning("status.namespaceClaim of %s/%s not written: %s", namespace, name, exc)
            return False
        return True
