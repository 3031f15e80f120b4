"""Why a stage that wants Active is not woken now: the arbiter's blockers (pure data).

Re-exported by :mod:`.arbiter` (``from omnistage_operator.decisions.arbiter import Blocker`` keeps
working).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

__all__ = ["BlockReason", "Blocker"]


class BlockReason(StrEnum):
    """Why a stage that wants Active is not woken now (CamelCase: usable as condition reasons)."""

    MEMORY_CLAIMED = "MemoryClaimed"  # admitted stages before it take the memory
    TOO_LARGE = "LargerThanDevice"  # its footprint exceeds the whole capacity
    MUST_SLEEP = "HoldsMemory"  # a stage outside the admitted set still holds memory
    AWAITING_ACK = "AwaitingSleepAck"  # a sleeper of this hand-over has no ok ACK yet
    UNREACHABLE = "Unreachable"  # a holder does not answer; it is fenced before any wake
    FREE_TOO_LOW = "MeasuredFreeTooLow"  # measured free memory does not cover the footprint
    SELF_BUSY = "Transitioning"  # its own worker is starting, loading, sleeping or failed
    NOT_MEASURED = "MemoryNotMeasured"  # no measured free memory: the gate stays closed
    FENCE_PENDING = "FencePending"  # a fence was started and its pod is not confirmed gone
    ACK_CONTRADICTED = "AckContradicted"  # an ok sleep ACK the device's figures contradict
    WORKER_FAILED = "WorkerFailed"  # a FAILED worker holds memory until fenced
    PODS_STARTING = "PodsStarting"  # pods started in this round: contexts not measured yet
    DEVICE_MISMATCH = "DeviceMismatch"  # a worker sees other devices than the group's claim
    CLAIM_TOO_SMALL = "ClaimTooSmall"  # the stage needs more GPUs than the group's claim has
    NO_ROOM = "NoRoomForComponents"  # waking its asleep components would not fit the group
    UNKNOWN_COMPONENTS = "UnknownComponents"  # spec names components its worker does not have


@dataclass(frozen=True)
class Blocker:
    """One reason a stage waits; ``stage`` names the stage in the way, if any.

    A memory blocker carries its figures: the ``device`` (UUID, ``""`` for a host-accounting
    group), the measured ``free`` memory there, what the stage ``needed`` there, and who holds
    the rest (``holders``: the group's stages by name, and ``footprints.OTHER_TENANTS``).
    """

    reason: BlockReason
    message: str
    stage: str | None = None
    device: str | None = None
    free: int | None = None
    needed: int | None = None
    holders: tuple[tuple[str, int], ...] = ()
