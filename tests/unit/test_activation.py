"""spec.activation parsed: durations, bounds, Manual-only refusals, worker flags."""

from __future__ import annotations

import pytest

from omnistage_operator.api.activation import (
    Activation,
    ActivationError,
    ActivationPolicy,
    parse_activation,
    parse_duration,
)


def test_durations() -> None:
    assert parse_duration("90s", "x") == 90.0
    assert parse_duration("1m30s", "x") == 90.0
    assert parse_duration("500ms", "x") == 0.5
    assert parse_duration("1.5h", "x") == 5400.0
    for bad in ("90", "1d", "", "-1s", 5):
        with pytest.raises(ActivationError, match="must be a duration"):
            parse_duration(bad, "x")


def test_defaults_and_on_demand() -> None:
    assert parse_activation({}) == Activation()
    got = parse_activation(
        {
            "activation": {
                "policy": "OnDemand",
                "idleAfter": "5m",
                "minResidency": "2s",
                "holdTimeout": "30s",
            }
        }
    )
    assert got == Activation(ActivationPolicy.ON_DEMAND, 300.0, 2.0, 30.0)
    assert got.policy.cli == "ondemand"


@pytest.mark.parametrize(
    ("activation", "field", "why"),
    [
        ({"policy": "Lazy"}, "spec.activation.policy", "Manual or OnDemand"),
        ({"idleAfter": "5m"}, "spec.activation.idleAfter", "only to policy OnDemand"),
        ({"policy": "OnDemand", "holdTimeout": "10ms"}, "spec.activation.holdTimeout", "between"),
        ({"policy": "OnDemand", "idleAfter": "0s"}, "spec.activation.idleAfter", "between"),
    ],
)
def test_refusals_name_the_field(activation: dict[str, str], field: str, why: str) -> None:
    with pytest.raises(ActivationError) as info:
        parse_activation({"activation": activation})
    assert info.value.field == field and why in info.value.message
