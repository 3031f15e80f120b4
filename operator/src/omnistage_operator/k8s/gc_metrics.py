"""The operator's garbage collections timed (``omnistage_gc_seconds_total{generation}``: wall-clock;
``omnistage_gc_cpu_seconds_total{generation}``: the collecting thread's CPU time, which a loaded
machine's preemption does not inflate).

A full collection walks every object the operator keeps, so it costs more the more stages it
knows, and it stops the event loop (and, holding the GIL, the election thread) while it runs:
prometheus_client's own ``python_gc_collections_total`` counts collections, not their time.
"""

from __future__ import annotations

import gc
import time
from typing import Any

from prometheus_client import Counter

__all__ = ["GC_CPU_SECONDS", "GC_SECONDS", "install"]

GC_SECONDS = Counter(
    "omnistage_gc_seconds_total",
    "Seconds the operator spent in Python's garbage collections, by generation",
    ["generation"],
)

GC_CPU_SECONDS = Counter(
    "omnistage_gc_cpu_seconds_total",
    "CPU seconds of the thread that ran Python's garbage collections, by generation",
    ["generation"],
)

_started: list[float] = []


def _timed(phase: str, info: dict[str, Any]) -> None:
    if phase == "start":
        _started[:] = [time.perf_counter(), time.thread_time()]
    elif _started:
        generation = str(info.get("generation", "?"))
        GC_SECONDS.labels(generation).inc(time.perf_counter() - _started[0])
        GC_CPU_SECONDS.labels(generation).inc(time.thread_time() - _started[1])
        _started.clear()


def install() -> None:
    """Time every collection from now on (once)."""
    if _timed not in gc.callbacks:
        gc.callbacks.append(_timed)
