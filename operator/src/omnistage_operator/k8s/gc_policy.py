"""How the operator's Python garbage collector runs (``OMNISTAGE_GC_THRESHOLDS``,
``OMNISTAGE_GC_FREEZE``).

The collector exists for reference cycles; everything else is freed by reference counting.
Python runs a young collection each time its tracked objects allocated less those freed reach
700, a middle one every 10 young ones, and a full one every 10 middle ones once the objects
promoted since the last reach a quarter of the oldest generation. In a storm hundreds of
rounds hold their bodies and gRPC calls across awaits for seconds, so young collections promote
most of what they see and full ones come every 70 000 objects net, each walking the whole heap
(it grows with the stages) with the event loop stopped: at 1000 stages the operator spent 55 s
of wall-clock time in collections against 146 CPU-s, 39 s of it in 67 full collections of 0.59
s each (53f69f8, README's scale section). Here a young collection comes every 50 000 objects
net (a round's objects are mostly freed before one sees them) and a full one at most once every 10
million; what the start-up built (modules, classes, kopf's registry, the API clients) is frozen
(``gc.freeze``) out of every collection. Measured at 1000 stages, setup and four storms
(bench/results/scale_1000_gc_off.json, scale_1000_gc.json): 7764 / 707 / 51 collections (young
/ middle / full) -> 78 / 3 / 0, their CPU 24.9 of 124 operator CPU-s -> 6.3 of 112.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client import Gauge

__all__ = ["DEFAULT_THRESHOLDS", "FROZEN", "GcPolicy", "GcPolicyError", "apply", "freeze", "parse"]

log = logging.getLogger(__name__)

# generation 0 objects, generation-0 collections per generation 1, generation-1 per generation 2
DEFAULT_THRESHOLDS = (50_000, 20, 10)

FROZEN = Gauge(
    "omnistage_gc_frozen_objects",
    "Objects the operator froze out of garbage collection after its start-up (gc.freeze)",
)


class GcPolicyError(ValueError):
    """``OMNISTAGE_GC_THRESHOLDS`` or ``OMNISTAGE_GC_FREEZE`` has an invalid value."""


@dataclass(frozen=True)
class GcPolicy:
    """Thresholds to set (None: the interpreter's own) and whether to freeze after start-up."""

    thresholds: tuple[int, int, int] | None = DEFAULT_THRESHOLDS
    freeze: bool = True


def parse(env: Mapping[str, str]) -> GcPolicy:
    """The policy from the environment: ``OMNISTAGE_GC_THRESHOLDS`` is three positive integers
    (``gen0,gen1,gen2``) or ``python`` (the interpreter's defaults); ``OMNISTAGE_GC_FREEZE``
    is ``true`` or ``false``. Unset: ``DEFAULT_THRESHOLDS`` and freezing."""
    raw = env.get("OMNISTAGE_GC_THRESHOLDS", "").strip()
    thresholds: tuple[int, int, int] | None = DEFAULT_THRESHOLDS
    if raw.lower() == "python":
        thresholds = None
    elif raw:
        parts = raw.split(",")
        try:
            values = [int(p) for p in parts]
        except ValueError:
            values = []
        if len(values) != 3 or min(values) < 1:
            raise GcPolicyError(
                f"OMNISTAGE_GC_THRESHOLDS={raw!r}: three positive integers or 'python'"
            )
        thresholds = (values[0], values[1], values[2])
    flag = env.get("OMNISTAGE_GC_FREEZE", "true").strip().lower()
    if flag not in ("true", "false"):
        raise GcPolicyError(f"OMNISTAGE_GC_FREEZE={flag!r}: true or false")
    return GcPolicy(thresholds, flag == "true")


def apply(policy: GcPolicy) -> None:
    """Set the policy's thresholds (at the process's start)."""
    if policy.thresholds is not None:
        gc.set_threshold(*policy.thresholds)
    log.info("gc thresholds %s", gc.get_threshold())


def freeze(policy: GcPolicy) -> int:
    """After the start-up: the start-up's garbage collected, then everything alive frozen out
    of later collections (objects still freed when unreferenced). Returns the frozen count."""
    if policy.freeze:
        gc.collect()
        gc.freeze()
    frozen = gc.get_freeze_count()
    FROZEN.set(frozen)
    log.info("gc: %d objects frozen after start-up", frozen)
    return frozen
