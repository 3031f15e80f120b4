"""The operator times its garbage collections by generation (``k8s.gc_metrics``)."""

from __future__ import annotations

import gc
from typing import Any

from omnistage_operator.k8s import gc_metrics


def _seconds(generation: str, counter: Any = gc_metrics.GC_SECONDS) -> float:
    return float(counter.labels(generation)._value.get())


def test_a_full_collection_is_timed_under_its_generation() -> None:
    gc_metrics.install()
    gc_metrics.install()  # once: a second install adds no second callback
    assert gc.callbacks.count(gc_metrics._timed) == 1
    before, cpu = _seconds("2"), _seconds("2", gc_metrics.GC_CPU_SECONDS)
    garbage: list[object] = [[i] for i in range(100_000)]
    garbage.append(garbage)  # a cycle: only the collector frees it
    del garbage
    gc.collect(2)
    assert _seconds("2") > before
    assert _seconds("2", gc_metrics.GC_CPU_SECONDS) > cpu  # the collecting thread's CPU time
