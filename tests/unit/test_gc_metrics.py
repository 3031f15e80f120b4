"""The operator times its garbage collections by generation (``k8s.gc_metrics``)."""

from __future__ import annotations

import gc

from omnistage_operator.k8s import gc_metrics


def _seconds(generation: str) -> float:
    return float(gc_metrics.GC_SECONDS.labels(generation)._value.get())


def test_a_full_collection_is_timed_under_its_generation() -> None:
    gc_metrics.install()
    gc_metrics.install()  # once: a second install adds no second callback
    assert gc.callbacks.count(gc_metrics._timed) == 1
    before = _seconds("2")
    garbage: list[object] = [[i] for i in range(100_000)]
    garbage.append(garbage)  # a cycle: only the collector frees it
    del garbage
    gc.collect(2)
    assert _seconds("2") > before
