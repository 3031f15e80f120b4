"""Component-level sleep in status: per-component figures and the ``ComponentsSettled`` condition.

Pure logic (no kopf, no network). A diffusion stage's ``spec.asleepComponents`` names the
pipeline components its worker keeps asleep while Active; the worker reports every component's
weights and where they are (``ComponentFacts``). ``ComponentsSettled`` is True when the worker's
asleep components are the spec's, else False with why: an order on its way, no room in the group
for the components to wake, names the worker does not have, or the worker's refusal.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from omnistage_operator.decisions.arbiter import Blocker, ComponentFacts, WorkerPhase
from omnistage_worker.quantities import format_bytes

__all__ = [
    "COMPONENTS_SETTLED",
    "ComponentVerdict",
    "component_status",
    "components_verdict",
]

COMPONENTS_SETTLED: Final = "ComponentsSettled"

ComponentVerdict = tuple[bool, str, str]  # the condition's status, reason and message


def component_status(components: Sequence[ComponentFacts]) -> list[dict[str, Any]] | None:
    """``status.memory.components``: name, bytes, Resident or Asleep (None: undivided model)."""
    if not components:
        return None
    return [
        {
            "name": c.name,
            "weightsBytes": c.weights_bytes,
            "deviceBytes": c.device_bytes,
            "weights": format_bytes(c.weights_bytes),
            "state": "Asleep" if c.asleep else "Resident",
            "level": c.level,
        }
        for c in components
    ]


def components_verdict(
    wanted: Sequence[str],
    phase: WorkerPhase,
    components: Sequence[ComponentFacts],
    waiting: Sequence[Blocker] = (),
    problem: tuple[str, str] | None = None,
) -> ComponentVerdict | None:
    """The ``ComponentsSettled`` condition, or None when the stage has nothing to say about
    components (none wanted asleep and none asleep)."""
    asleep = sorted(c.name for c in components if c.asleep)
    want = sorted(set(wanted))
    if not want and not asleep:
        return None
    if waiting:
        return False, waiting[0].reason.value, "; ".join(b.message for b in waiting)
    if problem is not None:
        return False, problem[0], problem[1]
    if phase is not WorkerPhase.ACTIVE:
        return False, "WorkerNotActive", f"components are set while Active; worker is {phase}"
    if asleep == want:
        kept = sum(c.weights_bytes for c in components if c.asleep)
        if not want:
            return True, "ComponentsResident", "every component is resident"
        return True, "ComponentsAsleep", f"{', '.join(want)} asleep ({format_bytes(kept)})"
    return (
        False,
        "ComponentsPending",
        f"asleep: {', '.join(asleep) or 'none'}; spec.asleepComponents: "
        f"{', '.join(want) or 'none'}",
    )
