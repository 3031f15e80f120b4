"""Demand shaped into the arbiter's intents: held asks, idle sleep, residency, priority."""

from __future__ import annotations

from dataclasses import replace

from omnistage_operator.api.activation import Activation, ActivationPolicy
from omnistage_operator.decisions.arbiter import StageIntent, WorkerPhase
from omnistage_operator.decisions.arbiter.admission import admission_order
from omnistage_operator.decisions.ondemand import AwakeReason, Demand, DemandInput, shape_intents

ON = Activation(ActivationPolicy.ON_DEMAND, idle_after_s=30.0, min_residency_s=10.0)
A, S = WorkerPhase.ACTIVE, WorkerPhase.ASLEEP


def intent(name: str, want: bool = False, priority: int = 0, at: float = 0.0) -> StageIntent:
    return StageIntent(name, want_active=want, priority=priority, requested_active_at=at)


def test_held_requests_ask_for_active_from_the_oldest_hold() -> None:
    view = shape_intents(
        {"a": intent("a"), "b": intent("b")},
        {
            "a": DemandInput(ON, A, Demand(last_request=95.0), awake_since=50.0),
            "b": DemandInput(ON, S, Demand(held=2, oldest_hold_start=99.0)),
        },
        now=100.0,
    )
    assert view.intents["b"].want_active and view.intents["b"].requested_active_at == 99.0
    assert view.demand_asks == {"b"}
    assert view.reasons == {"a": AwakeReason.DEMAND, "b": AwakeReason.DEMAND}
    # a is past its residency: b's held ask goes first (a swap)
    assert admission_order(view.intents)[0] == "b"


def test_within_min_residency_an_equal_priority_demand_waits() -> None:
    view = shape_intents(
        {"a": intent("a"), "b": intent("b")},
        {
            "a": DemandInput(ON, A, Demand(last_request=95.0), awake_since=95.0),
            "b": DemandInput(ON, S, Demand(held=1, oldest_hold_start=99.0)),
        },
        now=100.0,
    )
    assert admission_order(view.intents)[0] == "a"
    assert view.reasons["a"] is AwakeReason.RESIDENCY
    assert view.recheck_at == 105.0  # the residency ends: look again


def test_a_higher_priority_demand_displaces_a_resident_stage() -> None:
    view = shape_intents(
        {"a": intent("a"), "b": intent("b", priority=5)},
        {
            "a": DemandInput(ON, A, Demand(last_request=99.0), awake_since=99.0),
            "b": DemandInput(ON, S, Demand(held=1, oldest_hold_start=99.5)),
        },
        now=100.0,
    )
    assert admission_order(view.intents)[0] == "b"


def test_an_idle_stage_asks_for_nothing_and_a_busy_one_is_never_idle() -> None:
    intents = {"a": intent("a")}
    idle = DemandInput(ON, A, Demand(last_request=60.0), awake_since=10.0)
    view = shape_intents(intents, {"a": idle}, now=90.0)
    assert not view.intents["a"].want_active and "a" not in view.reasons
    assert view.idle == {"a"}
    not_yet = shape_intents(intents, {"a": idle}, now=89.0)
    assert not_yet.intents["a"].want_active and not_yet.recheck_at == 90.0
    busy = DemandInput(ON, A, Demand(last_request=10.0, inflight=1), awake_since=10.0)
    assert shape_intents(intents, {"a": busy}, now=1000.0).intents["a"].want_active


def test_without_idle_after_an_awake_stage_stays_until_displaced() -> None:
    forever = Activation(ActivationPolicy.ON_DEMAND)
    view = shape_intents(
        {"a": intent("a")}, {"a": DemandInput(forever, A, None, awake_since=0.0)}, now=1e6
    )
    assert view.intents["a"].want_active and view.recheck_at is None


def test_manual_asks_and_manual_stages_are_unchanged() -> None:
    pinned = intent("p", want=True, at=5.0)
    manual = intent("m", want=True, at=7.0)
    view = shape_intents(
        {"p": pinned, "m": manual, "q": intent("q")},
        {
            "p": DemandInput(ON, A, Demand(last_request=0.0), awake_since=0.0),
            "m": DemandInput(Activation(), S, Demand(held=3, oldest_hold_start=1.0)),
            "q": DemandInput(ON, WorkerPhase.LOADING, Demand(held=1, oldest_hold_start=1.0)),
        },
        now=1000.0,
    )
    assert view.intents["p"] == pinned and view.intents["m"] == manual
    assert view.reasons == {"p": AwakeReason.MANUAL, "m": AwakeReason.MANUAL}
    assert not view.intents["q"].want_active  # not loaded: it cannot be woken yet


def test_kept_over_a_lower_priority_demand_is_priority() -> None:
    view = shape_intents(
        {"a": intent("a", priority=3), "b": intent("b")},
        {
            "a": DemandInput(ON, A, Demand(last_request=99.0), awake_since=1.0),
            "b": DemandInput(ON, S, Demand(held=1, oldest_hold_start=99.0)),
        },
        now=100.0,
    )
    assert view.reasons["a"] is AwakeReason.PRIORITY
    assert admission_order(view.intents)[0] == "a"


def test_patched_asleep_after_it_woke_sleeps_now_and_demand_wakes_it_again() -> None:
    """Issue 19: an OnDemand stage patched to ``state: Asleep`` stayed Active for a minute and
    more (busy enough never to be idle, or within its residency); it is put to sleep now."""
    intents = {"a": intent("a")}
    forever = Activation(ActivationPolicy.ON_DEMAND)  # no idleAfter: never idle by itself
    busy = Demand(last_request=99.0)
    for activation in (ON, forever):
        kept = shape_intents(intents, {"a": DemandInput(activation, A, busy, 95.0)}, now=100.0)
        assert kept.intents["a"].want_active  # without the patch: kept awake
        patched = DemandInput(activation, A, busy, awake_since=95.0, asleep_asked_at=99.5)
        view = shape_intents(intents, {"a": patched}, now=100.0)
        assert not view.intents["a"].want_active and "a" not in view.reasons
        assert view.idle == frozenset()  # not idle (no IdleSleep): asked to sleep
    # A request held after the patch wakes it again, and the woken stage keeps its usual rules.
    held = DemandInput(ON, S, Demand(held=1, oldest_hold_start=101.0), asleep_asked_at=99.5)
    assert shape_intents(intents, {"a": held}, now=102.0).intents["a"].want_active
    woke = DemandInput(ON, A, Demand(last_request=103.0), awake_since=103.0, asleep_asked_at=99.5)
    assert shape_intents(intents, {"a": woke}, now=104.0).intents["a"].want_active


def test_a_patch_to_asleep_read_back_after_a_restart_sleeps_whenever_it_woke() -> None:
    """A restarted operator sees the stage awake since its own start (after the patch): the
    patch read back from status (``asleep_pending``) still puts it to sleep now."""
    intents = {"a": StageIntent("a", False)}
    busy = Demand(inflight=0, last_request=99.0)
    restarted = DemandInput(ON, A, busy, awake_since=120.0, asleep_asked_at=99.5)
    assert shape_intents(intents, {"a": restarted}, now=121.0).intents["a"].want_active
    pending = replace(restarted, asleep_pending=True)
    assert not shape_intents(intents, {"a": pending}, now=121.0).intents["a"].want_active
