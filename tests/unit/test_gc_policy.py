"""The operator's garbage-collection policy (``k8s.gc_policy``): parsed from the environment,
thresholds set, the start-up frozen."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from omnistage_operator.k8s import gc_policy
from omnistage_operator.k8s.gc_policy import DEFAULT_THRESHOLDS, GcPolicy, GcPolicyError


def test_unset_means_larger_generations_and_a_freeze() -> None:
    assert gc_policy.parse({}) == GcPolicy(DEFAULT_THRESHOLDS, True)
    assert DEFAULT_THRESHOLDS[0] > gc.get_threshold()[0]  # larger than the interpreter's 700


@pytest.mark.parametrize(
    ("env", "policy"),
    [
        ({"OMNISTAGE_GC_THRESHOLDS": "python"}, GcPolicy(None, True)),
        ({"OMNISTAGE_GC_THRESHOLDS": " 1000, 5,7 "}, GcPolicy((1000, 5, 7), True)),
        ({"OMNISTAGE_GC_FREEZE": "false"}, GcPolicy(DEFAULT_THRESHOLDS, False)),
        ({"OMNISTAGE_GC_FREEZE": "True", "OMNISTAGE_GC_THRESHOLDS": ""}, GcPolicy()),
    ],
)
def test_the_environment_overrides(env: dict[str, str], policy: GcPolicy) -> None:
    assert gc_policy.parse(env) == policy


@pytest.mark.parametrize(
    "env",
    [
        {"OMNISTAGE_GC_THRESHOLDS": "1000,5"},
        {"OMNISTAGE_GC_THRESHOLDS": "1000,0,5"},
        {"OMNISTAGE_GC_THRESHOLDS": "a,b,c"},
        {"OMNISTAGE_GC_FREEZE": "yes"},
    ],
)
def test_invalid_values_are_refused(env: dict[str, str]) -> None:
    with pytest.raises(GcPolicyError):
        gc_policy.parse(env)


@pytest.fixture
def restored() -> Iterator[None]:
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


@pytest.mark.usefixtures("restored")
def test_apply_sets_thresholds_and_freeze_counts_what_it_froze() -> None:
    gc_policy.apply(GcPolicy((12_345, 6, 7), False))
    assert gc.get_threshold() == (12_345, 6, 7)
    assert gc_policy.freeze(GcPolicy((12_345, 6, 7), False)) == gc.get_freeze_count() == 0
    frozen = gc_policy.freeze(GcPolicy())
    assert frozen > 10_000  # this test process's modules, pytest's objects
    assert gc.get_freeze_count() > frozen - 100  # (frozen objects are still freed when unused)
    assert gc_policy.FROZEN._value.get() == frozen
