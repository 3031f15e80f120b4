"""Who may order a group's workers: the contract between leader election and hand-over rounds.

A hand-over round runs only while ``Leadership.leading()`` is true, and every Sleep and WakeUp
carries ``Leadership.epoch`` so a worker can refuse an order from a leader it has seen replaced.
``SoleWriter`` is the leadership of an operator that runs without election (epoch 0, which
workers always accept).
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["Leadership", "LeadershipLost", "SoleWriter"]


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
