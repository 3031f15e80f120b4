"""A state change the round's own Event on a stage names is told in that Event, not its own."""

from __future__ import annotations

from typing import Any

from omnistage_operator.decisions.state_events import fold_state_changes


def _body(name: str) -> dict[str, Any]:
    return {"metadata": {"namespace": "ns", "name": name, "uid": f"u-{name}"}}


AR, SD = _body("ar"), _body("sd")


def test_a_handovers_state_changes_ride_on_its_own_events() -> None:
    held = [
        (AR, "StateChanged", "Active -> Waiting", False),  # the checkpoint's, held first
        (AR, "Slept", "ACK h1-ar-sleep1: level 1", False),
        (SD, "Woken", "ACK h1-sd-wake: used 1 MiB", False),
        (AR, "Waiting", "InsufficientMemory: free 0", False),
        (SD, "StateChanged", "Asleep -> Active", False),
    ]
    assert fold_state_changes(held) == [
        (AR, "Slept", "ACK h1-ar-sleep1: level 1", False),
        (SD, "Woken", "ACK h1-sd-wake: used 1 MiB; state Asleep -> Active", False),
        (AR, "Waiting", "InsufficientMemory: free 0; state Active -> Waiting", False),
    ]


def test_a_change_no_event_names_keeps_its_own() -> None:
    held = [
        (AR, "AckContradicted", "the device still holds 1 GiB", True),
        (AR, "StateChanged", "Active -> Failed", False),
        (SD, "Slept", "ACK h1-sd-sleep1", False),
        (AR, "StateChanged", "Waiting -> Asleep", False),  # another stage's Slept: not ar's
    ]
    assert fold_state_changes(held) == held
