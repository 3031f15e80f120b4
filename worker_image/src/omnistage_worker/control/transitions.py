"""The worker's state machine as pure decisions: what a Sleep or WakeUp must do now.

No I/O here; :mod:`omnistage_worker.control.sleep_wake` carries the plans out.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

import grpc

from omnistage.worker.v1 import types_pb2
from omnistage_worker.memory.base import Reading

WS = types_pb2.WorkerState


class Plan(enum.Enum):
    """What a request needs."""

    NOOP = "noop"
    SLEEP = "sleep"  # active -> asleep (weights leave the device)
    DEEPEN = "deepen"  # asleep at 1 -> asleep at 2 (the host copy is dropped)
    WAKE = "wake"  # asleep -> active
    RECHECK = "recheck"  # failed its residual check: release cached memory, measure again


class Refused(Exception):
    """A request that cannot be served now; ``code`` is the gRPC status to answer."""

    def __init__(
        self, code: grpc.StatusCode, message: str, retry_after: float | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        # Seconds after which a retry may succeed (sent as a "retry-after" trailer / header).
        self.retry_after = retry_after


@dataclass(frozen=True)
class Current:
    """The worker's state as the planner sees it."""

    state: WS.ValueType
    level: int  # 0 when awake (for a failed residual check: the level the weights are at)
    error: str = ""
    # FAILED only because memory was still in use after a sleep: the weights are off the
    # device, and a later Sleep may measure again (the only way out of FAILED).
    residual: bool = False


def _refuse_unready(current: Current) -> None:
    if current.state == types_pb2.WORKER_STATE_LOADING:
        raise Refused(grpc.StatusCode.UNAVAILABLE, "worker is loading the model")
    if current.state == types_pb2.WORKER_STATE_FAILED:
        raise Refused(grpc.StatusCode.FAILED_PRECONDITION, f"worker failed: {current.error}")


def plan_sleep(current: Current, level: int) -> Plan:
    """Plan a sleep to ``level`` (1 or 2).

    Sleeping at the current level is a no-op; asleep at 2, a sleep at 1 is a no-op too (the
    device memory is already free; the Ack reports level 2). A worker that failed its residual
    check is measured again (:attr:`Plan.RECHECK`); any other failure refuses.
    """
    if current.state == types_pb2.WORKER_STATE_FAILED and current.residual:
        return Plan.RECHECK
    _refuse_unready(current)
    if current.state == types_pb2.WORKER_STATE_ACTIVE:
        return Plan.SLEEP
    if current.state == types_pb2.WORKER_STATE_ASLEEP:
        return Plan.DEEPEN if level > current.level else Plan.NOOP
    raise Refused(grpc.StatusCode.INTERNAL, f"unexpected state {WS.Name(current.state)}")


def plan_wake(current: Current) -> Plan:
    """Plan a wake: a no-op while awake; FAILED_PRECONDITION with the reason when failed.

    A worker that failed its residual check is never woken: it may still hold memory the
    operator counted as free, so the operator fences it (or a later Sleep measures again).
    """
    _refuse_unready(current)
    if current.state == types_pb2.WORKER_STATE_ACTIVE:
        return Plan.NOOP
    if current.state == types_pb2.WORKER_STATE_ASLEEP:
        return Plan.WAKE
    raise Refused(grpc.StatusCode.INTERNAL, f"unexpected state {WS.Name(current.state)}")


def generate_refusal(current: Current) -> Refused | None:
    """Why a Generate cannot run now, or None when it can."""
    state = current.state
    if state == types_pb2.WORKER_STATE_ACTIVE:
        return None
    if state == types_pb2.WORKER_STATE_ASLEEP:
        return Refused(
            grpc.StatusCode.FAILED_PRECONDITION, f"worker is asleep (level {current.level})"
        )
    if state == types_pb2.WORKER_STATE_SLEEPING:
        return Refused(grpc.StatusCode.FAILED_PRECONDITION, "worker is sleeping")
    if state == types_pb2.WORKER_STATE_WAKING:
        return Refused(grpc.StatusCode.FAILED_PRECONDITION, "worker is waking")
    if state == types_pb2.WORKER_STATE_LOADING:
        return Refused(grpc.StatusCode.UNAVAILABLE, "worker is loading the model")
    return Refused(grpc.StatusCode.FAILED_PRECONDITION, f"worker failed: {current.error}")


HOLDABLE = frozenset(
    {
        types_pb2.WORKER_STATE_ASLEEP,
        types_pb2.WORKER_STATE_SLEEPING,
        types_pb2.WORKER_STATE_WAKING,
    }
)


def holdable(current: Current) -> bool:
    """Whether an OnDemand worker holds a request now (asleep or in a transition)."""
    return current.state in HOLDABLE


def residual_error(used_after: int, bound: int) -> str:
    """The reason a sleep's Ack is not ok, or "" when the residual is within the bound."""
    if used_after <= bound:
        return ""
    return (
        f"device memory still used after sleep: {used_after} bytes measured, "
        f"above the bound of {bound} bytes (baseline + residual slack)"
    )


def device_residual_error(after: Reading, baselines: Mapping[str, int], slack: int) -> str:
    """Per device: the reason a sleep's Ack is not ok ("" when every device is within its
    bound, its own baseline + ``slack``). One device that keeps memory fails the whole Ack."""
    if len(after.devices) <= 1:
        return residual_error(after.used, sum(baselines.values()) + slack)
    errors = []
    for device in after.devices:
        error = residual_error(device.used, baselines.get(device.device, 0) + slack)
        if error:
            errors.append(f"{device.device}: {error}")
    return "; ".join(errors)


def require_epoch(epoch: int) -> None:
    """INVALID_ARGUMENT for a negative epoch (orders and status reads alike)."""
    if epoch < 0:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"epoch: {epoch} is negative")


def check_epoch(order: int, obeyed: int) -> None:
    """Refuse an order from an older leadership epoch than the highest this worker obeyed.

    Epoch 0 means no leader election: accepted only while this worker has obeyed no epoch
    (a worker that has obeyed an elected leader refuses it: an operator without election
    beside an elected one would otherwise bypass the epoch fence).
    """
    require_epoch(order)
    if order and order < obeyed:
        raise Refused(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"order from epoch {order} refused: this worker has obeyed epoch {obeyed}",
        )
    if not order and obeyed:
        raise Refused(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"order from epoch 0 (no leader election) refused: this worker has obeyed "
            f"epoch {obeyed}",
        )


def drain_timeout_from_proto(seconds: float | None) -> float | None:
    """A request's drain timeout in seconds (None: unset); INVALID_ARGUMENT when negative."""
    if seconds is not None and seconds < 0:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"drain_timeout: {seconds:g}s is negative")
    return seconds


def level_from_proto(value: int) -> int:
    """A request's SleepLevel as 1 or 2; INVALID_ARGUMENT naming the field otherwise."""
    if value == types_pb2.SLEEP_LEVEL_OFFLOAD:
        return 1
    if value == types_pb2.SLEEP_LEVEL_DISCARD:
        return 2
    if value == types_pb2.SLEEP_LEVEL_UNSPECIFIED:
        raise Refused(
            grpc.StatusCode.INVALID_ARGUMENT,
            "level: required (SLEEP_LEVEL_OFFLOAD or SLEEP_LEVEL_DISCARD)",
        )
    raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"level: {value} is not a sleep level (1 or 2)")


def require_task_id(task_id: str) -> str:
    """The task id, or INVALID_ARGUMENT when it is empty."""
    if not task_id.strip():
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "task_id: required (must not be empty)")
    if len(task_id) > 256:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "task_id: longer than 256 characters")
    return task_id
