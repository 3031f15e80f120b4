"""metav1.Condition lists for OmniStage status (pure logic, no kopf, no network).

Conditions are plain dicts in the Kubernetes shape: ``type``, ``status`` (``"True"``,
``"False"``, ``"Unknown"``), ``reason`` (CamelCase), ``message``, ``lastTransitionTime``
(RFC 3339, seconds, ``Z``) and ``observedGeneration``. Functions never mutate their input.

Public API (stable):

Types: ``READY="Ready"``, ``ASLEEP="Asleep"``, ``MEMORY_RELEASED="MemoryReleased"``,
    ``ADMITTED="Admitted"``; ``CONDITION_TYPES`` (that order).
Status: ``ConditionStatus`` (``TRUE="True"``, ``FALSE="False"``, ``UNKNOWN="Unknown"``).
Reasons (``Reason`` StrEnum; values are CamelCase, usable anywhere a ``str`` is):
    ``POD_PENDING``, ``LOADING``, ``WORKER_READY``, ``WORKER_NOT_READY``, ``WORKER_LOST``,
    ``SLEEPING``, ``SLEEP_ACKNOWLEDGED``, ``WAKING``, ``WAKE_ACKNOWLEDGED``, ``MEMORY_VERIFIED``,
    ``RESIDUAL_MEMORY``, ``ACK_FAILED``, ``ACK_TIMEOUT``, ``FENCED``, ``WAITING_FOR_MEMORY``,
    ``WAITING_FOR_ACKS``, ``ADMITTED``, ``DESIRED_ASLEEP``, ``INSUFFICIENT_MEMORY``,
    ``LOWER_PRIORITY``, ``SPEC_INVALID``, ``FAILED``, ``RESUMING``, ``SLEEP_REFUSED``,
    ``WAKE_REFUSED``, ``ACK_CONTRADICTED``, ``WORKER_FAILED``, ``FENCE_PENDING``,
    ``LARGER_THAN_DEVICE``, ``MEMORY_NOT_MEASURED``, ``DEVICE_MISMATCH``, ``DRAINING``,
    ``PODS_STARTING``, ``STAGE_ERROR``, ``CLAIM_TOO_SMALL``,
    ``WAITING_FOR_STAGE``.
Functions:
    ``set_condition(conditions, type, status, reason, message, observed_generation, now)
    -> list[dict]``: a new list with that condition set; ``lastTransitionTime`` is kept when
    the status does not change, else set to ``now``; other conditions are untouched, a new
    type is appended. Raises ``ValueError`` for a malformed type, status, reason or time.
    ``get_condition(conditions, type) -> dict | None``
    ``is_true(conditions, type) -> bool``
    ``format_time(now: datetime) -> str`` (``"2026-11-21T05:10:00Z"``; ``now`` must be aware)
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Final

__all__ = [
    "ADMITTED",
    "ASLEEP",
    "CONDITION_TYPES",
    "MEMORY_RELEASED",
    "READY",
    "ConditionStatus",
    "Reason",
    "format_time",
    "get_condition",
    "is_true",
    "set_condition",
]

READY: Final = "Ready"
ASLEEP: Final = "Asleep"
MEMORY_RELEASED: Final = "MemoryReleased"
ADMITTED: Final = "Admitted"
CONDITION_TYPES: Final = (READY, ASLEEP, MEMORY_RELEASED, ADMITTED)

MAX_MESSAGE_LENGTH: Final = 32768
_REASON = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
_TYPE = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$"
)


class ConditionStatus(StrEnum):
    """A condition's ``status``."""

    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class Reason(StrEnum):
    """CamelCase reasons the operator writes on its conditions."""

    POD_PENDING = "PodPending"
    LOADING = "Loading"
    WORKER_READY = "WorkerReady"
    WORKER_NOT_READY = "WorkerNotReady"
    WORKER_LOST = "WorkerLost"
    WORKER_UNAUTHENTICATED = "WorkerUnauthenticated"
    SLEEPING = "Sleeping"
    SLEEP_ACKNOWLEDGED = "SleepAcknowledged"
    WAKING = "Waking"
    WAKE_ACKNOWLEDGED = "WakeAcknowledged"
    MEMORY_VERIFIED = "MemoryVerified"
    RESIDUAL_MEMORY = "ResidualMemory"
    ACK_FAILED = "AckFailed"
    ACK_TIMEOUT = "AckTimeout"
    FENCED = "Fenced"
    WAITING_FOR_MEMORY = "WaitingForMemory"
    WAITING_FOR_ACKS = "WaitingForAcks"
    ADMITTED = "Admitted"
    DESIRED_ASLEEP = "DesiredAsleep"
    INSUFFICIENT_MEMORY = "InsufficientMemory"
    LOWER_PRIORITY = "LowerPriority"
    SPEC_INVALID = "SpecInvalid"
    FAILED = "Failed"
    RESUMING = "Resuming"
    SLEEP_REFUSED = "SleepRefused"  # the worker refused the sleep (its code and words follow)
    WAKE_REFUSED = "WakeRefused"
    ACK_CONTRADICTED = "AckContradicted"  # an ok sleep ACK the device's free memory belies
    WORKER_FAILED = "WorkerFailed"  # a FAILED worker holds memory until fenced
    FENCE_PENDING = "FencePending"  # pod deletion started, not confirmed: holds memory
    LARGER_THAN_DEVICE = "LargerThanDevice"  # its footprint (or learned need) exceeds a device
    MEMORY_NOT_MEASURED = "MemoryNotMeasured"  # no measured free memory: no wake on a guess
    DEVICE_MISMATCH = "DeviceMismatch"  # a worker sees other devices than the group's claim
    CLAIM_TOO_SMALL = "ClaimTooSmall"  # more GPUs than the group's claim holds
    DRAINING = "Draining"  # the sleep waits for in-flight requests (within the drain timeout)
    PODS_STARTING = "PodsStarting"
    STAGE_ERROR = "StageError"  # an unexpected error of this stage in a round (others go on)
    WAITING_FOR_STAGE = "WaitingForStage"  # a stage of the group must sleep (or be fenced) first


def format_time(now: datetime) -> str:
    """``now`` as a metav1.Time string (UTC, whole seconds)."""
    if now.tzinfo is None or now.utcoffset() is None:
        raise ValueError("condition times must be timezone-aware")
    return now.astimezone(UTC).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")


def _copied(cond: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of one condition: its values are scalars, so only a nested one is deep-copied
    (a deep copy of every condition of every status built was about 5% of the operator's CPU
    per hand-over, cProfile over ``bench/operator_switch.py``)."""
    return {k: copy.deepcopy(v) if isinstance(v, (dict, list)) else v for k, v in cond.items()}


def get_condition(
    conditions: Sequence[Mapping[str, Any]] | None, type_: str
) -> dict[str, Any] | None:
    """A copy of the condition of type ``type_``, or None."""
    for cond in conditions or ():
        if cond.get("type") == type_:
            return _copied(cond)
    return None


def is_true(conditions: Sequence[Mapping[str, Any]] | None, type_: str) -> bool:
    """Whether the condition of type ``type_`` exists with status ``"True"``."""
    cond = get_condition(conditions, type_)
    return cond is not None and cond.get("status") == ConditionStatus.TRUE.value


def set_condition(  # noqa: PLR0917 - the documented positional API
    conditions: Sequence[Mapping[str, Any]] | None,
    type_: str,
    status: ConditionStatus | str | bool,
    reason: str,
    message: str,
    observed_generation: int,
    now: datetime,
) -> list[dict[str, Any]]:
    """Return ``conditions`` with ``type_`` set; see the module docstring for the rules.

    ``status`` may be a bool (True -> ``"True"``). Messages longer than the API's limit are
    cut with an ellipsis rather than refused by the API server.
    """
    if not _TYPE.match(type_) or len(type_) > 316:
        raise ValueError(f"invalid condition type: {type_!r}")
    if isinstance(status, bool):
        status_value = ConditionStatus.TRUE if status else ConditionStatus.FALSE
    else:
        try:
            status_value = ConditionStatus(status)
        except ValueError:
            raise ValueError(f"invalid condition status: {status!r}") from None
    reason = str(reason)
    if len(reason) > 1024 or not _REASON.match(reason):
        raise ValueError(f"invalid condition reason (must be CamelCase): {reason!r}")
    if observed_generation < 0:
        raise ValueError(f"observedGeneration must not be negative: {observed_generation}")
    if len(message) > MAX_MESSAGE_LENGTH:
        message = message[: MAX_MESSAGE_LENGTH - 3] + "..."
    stamp = format_time(now)

    result: list[dict[str, Any]] = []
    found = False
    for cond in conditions or ():
        current = _copied(cond)
        if current.get("type") == type_ and not found:
            found = True
            same = current.get("status") == status_value.value
            transition = current.get("lastTransitionTime") if same else None
            current = _condition(
                type_=type_,
                status=status_value,
                reason=reason,
                message=message,
                observed_generation=observed_generation,
                last_transition_time=transition or stamp,
            )
        elif current.get("type") == type_:
            continue  # drop duplicates of the same type: the API keys the list by type
        result.append(current)
    if not found:
        result.append(
            _condition(
                type_=type_,
                status=status_value,
                reason=reason,
                message=message,
                observed_generation=observed_generation,
                last_transition_time=stamp,
            )
        )
    return result


def _condition(
    *,
    type_: str,
    status: ConditionStatus,
    reason: str,
    message: str,
    observed_generation: int,
    last_transition_time: str,
) -> dict[str, Any]:
    return {
        "type": type_,
        "status": status.value,
        "reason": reason,
        "message": message,
        "lastTransitionTime": last_transition_time,
        "observedGeneration": observed_generation,
    }
