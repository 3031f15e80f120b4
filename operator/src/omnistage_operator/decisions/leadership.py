"""Who may order a group's workers: the contract between leader election and hand-over rounds.

A hand-over round runs only while ``Leadership.leading()`` is true and this operator's shard
holds the namespace's claim (``NamespaceClaims.held``: two shards never order one namespace),
and every Sleep and WakeUp carries ``Leadership.epoch`` so a worker can refuse an order from a
leader it has seen replaced.
``SoleWriter`` is the leadership of an operator that runs without election (epoch 0, which
workers always accept).
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["AllNamespaces", "Leadership", "LeadershipLost", "NamespaceClaims", "SoleWriter"]


class LeadershipLost(Exception):
    """This operator stopped leading in the middle of a round: nothing more may be ordered."""


class Leadership(Protocol):
    """The operator's right to order workers."""

    @property
    def epoch(self) -> int:
        """The epoch orders carry (the Lease's transition count; 0 without election)."""
        ...

    def leading(self) -> bool:
        """True while the lease is held and was renewed within its renew deadline."""
        ...


class SoleWriter:
    """Leadership without election: always leading, epoch 0."""

    epoch = 0

    def leading(self) -> bool:
        """Always true."""
        return True


class NamespaceClaims(Protocol):
    """Which namespaces this operator's shard may order in (``k8s.claim_keeper``)."""

    @property
    def shard(self) -> str:
        """This shard's name (``<lease namespace>/<lease name>``)."""
        ...

    def want(self, namespace: str) -> None:
        """Claim ``namespace`` (from the next renewal on)."""
        ...

    def held(self, namespace: str) -> bool:
        """This shard holds the namespace's claim (renewed within the renew deadline)."""
        ...

    def claimant(self, namespace: str) -> str | None:
        """Another shard's holder found on the namespace's claim (None: none seen)."""
        ...

    def vacated(self, namespace: str) -> None:
        """No group of ``namespace`` is left: its claim (when a round asked for it) is dropped
        a lease duration from now, unless a round wants it again meanwhile."""
        ...

    def epoch(self, namespace: str, shard_epoch: int) -> int:
        """The epoch orders carry in ``namespace`` (``namespace_claims.order_epoch``)."""
        ...


class AllNamespaces:
    """Without election (one operator, no shards): every namespace, no claim."""

    shard = ""

    def want(self, namespace: str) -> None:
        """Nothing to claim."""

    def held(self, namespace: str) -> bool:
        """Always true."""
        return True

    def claimant(self, namespace: str) -> str | None:
        """Never another shard."""
        return None

    def vacated(self, namespace: str) -> None:
        """Nothing to drop."""

    def epoch(self, namespace: str, shard_epoch: int) -> int:
        """The operator's own epoch."""
        return shard_epoch
