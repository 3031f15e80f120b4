"""``spec.activation``: what wakes a stage and what puts it to sleep (pure parsing).

``Manual`` (default): only ``spec.state`` does. ``OnDemand``: the worker holds requests while
the stage sleeps and the operator wakes it for them (:mod:`.ondemand` shapes the arbiter's
intents from that demand); ``idleAfter`` puts an unused Active stage to sleep;
``minResidency`` keeps a demand-woken stage awake against another stage's demand of no higher
priority; ``holdTimeout`` bounds how long the worker holds a request.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

__all__ = [
    "DEFAULT_HOLD_TIMEOUT_S",
    "Activation",
    "ActivationError",
    "ActivationPolicy",
    "format_duration",
    "parse_activation",
    "parse_duration",
]

DEFAULT_HOLD_TIMEOUT_S = 60.0
_DURATION = re.compile(r"^(?:[0-9]+(?:\.[0-9]+)?(?:ms|s|m|h))+$")
_PART = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ms|s|m|h)")
_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


class ActivationError(ValueError):
    """An invalid ``spec.activation`` field; ``field`` is its dotted path."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class ActivationPolicy(StrEnum):
    """``spec.activation.policy``."""

    MANUAL = "Manual"
    ON_DEMAND = "OnDemand"

    @property
    def cli(self) -> str:
        """The worker's ``--activation`` value."""
        return "ondemand" if self is ActivationPolicy.ON_DEMAND else "manual"


@dataclass(frozen=True)
class Activation:
    """``spec.activation`` (seconds; ``idle_after_s`` None: never idle)."""

    policy: ActivationPolicy = ActivationPolicy.MANUAL
    idle_after_s: float | None = None
    min_residency_s: float = 0.0
    hold_timeout_s: float = DEFAULT_HOLD_TIMEOUT_S

    @property
    def on_demand(self) -> bool:
        return self.policy is ActivationPolicy.ON_DEMAND


def parse_duration(text: Any, path: str) -> float:
    """Seconds of a duration such as ``90s``, ``1m30s``, ``500ms``, ``2h``."""
    if not isinstance(text, str) or not _DURATION.match(text):
        raise ActivationError(path, f"must be a duration such as 90s, 5m or 500ms, got {text!r}")
    return sum(float(n) * _UNIT[unit] for n, unit in _PART.findall(text))


def format_duration(seconds: float) -> str:
    """A duration the worker's flags and the parser accept (``1.5s``, ``60s``)."""
    return f"{seconds:g}s" if math.isfinite(seconds) else "0s"


def _bounded(spec: Mapping[str, Any], key: str, low: float, high: float) -> float | None:
    path = f"spec.activation.{key}"
    if spec.get(key) is None:
        return None
    seconds = parse_duration(spec[key], path)
    if not low <= seconds <= high:
        raise ActivationError(path, f"must be between {low:g}s and {high:g}s, got {spec[key]}")
    return seconds


def parse_activation(spec: Mapping[str, Any]) -> Activation:
    """``spec.activation`` of a stage's spec (defaults: Manual)."""
    raw = spec.get("activation")
    if raw is None:
        return Activation()
    if not isinstance(raw, Mapping):
        raise ActivationError("spec.activation", "must be an object")
    policy_raw = raw.get("policy", ActivationPolicy.MANUAL.value)
    try:
        policy = ActivationPolicy(policy_raw)
    except ValueError:
        raise ActivationError(
            "spec.activation.policy", f"must be Manual or OnDemand, got {policy_raw!r}"
        ) from None
    idle = _bounded(raw, "idleAfter", 1.0, 168 * 3600.0)
    residency = _bounded(raw, "minResidency", 0.0, 24 * 3600.0)
    hold = _bounded(raw, "holdTimeout", 0.1, 3600.0)
    if policy is ActivationPolicy.MANUAL:
        for key in ("idleAfter", "minResidency", "holdTimeout"):
            if raw.get(key) is not None:
                raise ActivationError(f"spec.activation.{key}", "applies only to policy OnDemand")
    return Activation(
        policy=policy,
        idle_after_s=idle,
        min_residency_s=residency or 0.0,
        hold_timeout_s=DEFAULT_HOLD_TIMEOUT_S if hold is None else hold,
    )
