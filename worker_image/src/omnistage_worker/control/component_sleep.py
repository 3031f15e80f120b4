"""Component sleeps: put some of a pipeline's components to sleep while the worker stays Active.

The controller is a :class:`~omnistage_worker.engine.components.ComponentEngine`; a model
without separate components (one undivided engine, vLLM) refuses a Sleep that names any.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import grpc

from omnistage.worker.v1 import types_pb2
from omnistage_worker.control.acks import level_proto
from omnistage_worker.control.transitions import Refused
from omnistage_worker.runners.base import SleepController, Stats


@runtime_checkable
class Components(Protocol):
    """What a controller with separately sleeping components offers."""

    sequential: bool

    def resolve(self, names: Sequence[str]) -> list[str]: ...

    def sleep_components(self, names: Sequence[str], level: int) -> Stats: ...

    def asleep(self) -> list[str]: ...

    def figures(self) -> Sequence[Any]: ...


def with_components(controller: SleepController | None) -> Components | None:
    """The controller as a :class:`Components` one (None: one undivided model)."""
    return controller if isinstance(controller, Components) else None


def groups_to_sleep(controller: SleepController | None, names: Sequence[str]) -> list[str]:
    """The component groups a Sleep names, or the refusal (INVALID_ARGUMENT/FAILED_PRECOND.)."""
    components = with_components(controller)
    if components is None:
        raise Refused(
            grpc.StatusCode.INVALID_ARGUMENT, "components: this model has no separate components"
        )
    if components.sequential:
        raise Refused(
            grpc.StatusCode.FAILED_PRECONDITION,
            "components: in sequential mode the worker swaps its components itself",
        )
    try:
        return components.resolve(names)
    except Exception as exc:  # EngineError: an unknown name
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"components: {exc}") from exc


def asleep_components(controller: SleepController | None) -> list[str]:
    """Components asleep while the worker is Active (never in sequential mode: it swaps)."""
    components = with_components(controller)
    if components is None or components.sequential:
        return []
    return components.asleep()


def component_memory(controller: SleepController | None) -> list[types_pb2.ComponentMemory]:
    """Per-component figures for GetStatus and Acks (empty: one undivided model)."""
    components = with_components(controller)
    if components is None:
        return []
    return [
        types_pb2.ComponentMemory(
            name=f.name,
            weights_bytes=f.weights_bytes,
            device_bytes=f.device_bytes,
            level=level_proto(f.level),
        )
        for f in components.figures()
    ]
