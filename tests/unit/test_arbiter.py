"""Examples of the group arbiter's rules (property-based tests: test_handover_stateful)."""

from __future__ import annotations

from omnistage_operator.decisions.arbiter import (
    BlockReason,
    GroupMemory,
    Handover,
    SleepOrder,
    StageFacts,
    StageIntent,
    WorkerPhase,
)
from omnistage_operator.decisions.arbiter.admission import admission_order
from omnistage_operator.decisions.arbiter.demand import usable_memory
from omnistage_operator.decisions.arbiter.plan import plan

GI = 1 << 30
MI = 1 << 20
ACTIVE = StageFacts(WorkerPhase.ACTIVE, used_bytes=6 * GI, active_footprint=6 * GI)
ASLEEP = StageFacts(WorkerPhase.ASLEEP, level=1, active_footprint=6 * GI)


def test_admission_order_priority_then_latest_ask_then_name() -> None:
    intents = {
        "a": StageIntent("a", True, priority=0, requested_active_at=10),
        "b": StageIntent("b", True, priority=0, requested_active_at=20),
        "c": StageIntent("c", True, priority=5, requested_active_at=1),
        "d": StageIntent("d", False, priority=9),
        "e": StageIntent("e", True, priority=0, requested_active_at=20),
    }
    assert admission_order(intents) == ["c", "b", "e", "a"]


def test_switch_sleeps_holder_first_and_waits_for_its_ack() -> None:
    intents = {
        "ar": StageIntent("ar", True, requested_active_at=1),
        "dif": StageIntent("dif", True, requested_active_at=2, sleep_level=2),
    }
    facts = {"ar": ACTIVE, "dif": ASLEEP}
    mem = GroupMemory(capacity=10 * GI, free=4 * GI)
    d = plan(intents, facts, mem)
    assert d.admitted == ("dif",)
    assert d.sleep == (SleepOrder("ar", 1, True),)
    assert d.wake == ()
    assert d.waiting_for("dif") == ("ar",)
    assert d.waiting_for("ar") == ("dif",)

    # The sleep was sent but not ACKed yet: even a (stale) asleep fact does not open the gate.
    h = Handover("h1", sleepers=frozenset({"ar"}))
    asleep_ar = StageFacts(WorkerPhase.ASLEEP, level=1, active_footprint=6 * GI)
    d = plan(intents, {"ar": asleep_ar, "dif": ASLEEP}, GroupMemory(10 * GI, 10 * GI), h)
    assert d.wake == ()
    assert d.waiting["dif"][0].reason is BlockReason.AWAITING_ACK

    # With the ok ACK and measured free memory the wake is allowed.
    h = Handover("h1", sleepers=frozenset({"ar"}), acked=frozenset({"ar"}))
    d = plan(intents, {"ar": asleep_ar, "dif": ASLEEP}, GroupMemory(10 * GI, 10 * GI), h)
    assert d.wake == ("dif",)
    assert "dif" not in d.waiting


def test_measured_free_must_cover_footprint_with_margin() -> None:
    intents = {"a": StageIntent("a", True, vram_request=4 * GI)}
    facts = {"a": StageFacts(WorkerPhase.ASLEEP, level=1)}
    d = plan(intents, facts, GroupMemory(10 * GI, 4 * GI), margin_bytes=GI // 2)
    assert d.wake == ()
    assert d.waiting["a"][0].reason is BlockReason.FREE_TOO_LOW
    d = plan(intents, facts, GroupMemory(10 * GI, 5 * GI), margin_bytes=GI // 2)
    assert d.wake == ("a",)


def test_unreachable_holder_blocks_until_fenced() -> None:
    intents = {"a": StageIntent("a", False), "b": StageIntent("b", True, vram_request=GI)}
    facts = {
        "a": StageFacts(WorkerPhase.UNREACHABLE),
        "b": StageFacts(WorkerPhase.ASLEEP, level=1),
    }
    d = plan(intents, facts, GroupMemory(10 * GI, 10 * GI))
    assert d.sleep == (SleepOrder("a", 1, True),)
    assert d.wake == ()
    assert d.waiting["b"][0].reason is BlockReason.UNREACHABLE
    h = Handover("h", sleepers=frozenset({"a"}), fenced=frozenset({"a"}))
    facts = {"a": StageFacts(WorkerPhase.ABSENT), "b": facts["b"]}
    assert plan(intents, facts, GroupMemory(10 * GI, 10 * GI), h).wake == ("b",)


def test_unknown_capacity_admits_one_and_whole_device_default() -> None:
    intents = {
        "a": StageIntent("a", True, requested_active_at=1),
        "b": StageIntent("b", True, requested_active_at=2),
    }
    facts = {"a": StageFacts(WorkerPhase.STARTING), "b": StageFacts(WorkerPhase.STARTING)}
    d = plan(intents, facts, GroupMemory())
    assert d.admitted == ("b",)
    assert d.waiting["b"][0].reason is BlockReason.SELF_BUSY
    # No footprint known: each takes the whole device, so only one is admitted.
    d = plan(intents, facts, GroupMemory(8 * GI, 8 * GI))
    assert d.admitted == ("b",)
    assert d.waiting_for("a") == ("b",)


def test_two_fit_together_and_too_large_is_never_admitted() -> None:
    intents = {
        "a": StageIntent("a", True, vram_request=3 * GI),
        "b": StageIntent("b", True, vram_request=3 * GI),
        "huge": StageIntent("huge", True, priority=10, vram_request=20 * GI),
    }
    facts = {n: StageFacts(WorkerPhase.ASLEEP, level=1) for n in intents}
    d = plan(intents, facts, GroupMemory(8 * GI, 8 * GI))
    assert set(d.admitted) == {"a", "b"}
    assert set(d.wake) == {"a", "b"}
    assert d.waiting["huge"][0].reason is BlockReason.TOO_LARGE


def test_wakes_in_one_decision_are_charged_against_free() -> None:
    intents = {
        "a": StageIntent("a", True, vram_request=3 * GI),
        "b": StageIntent("b", True, vram_request=3 * GI),
    }
    facts = {n: StageFacts(WorkerPhase.ASLEEP, level=1) for n in intents}
    d = plan(intents, facts, GroupMemory(8 * GI, 5 * GI))
    assert len(d.wake) == 1
    # Issue 14: admission counts the memory the group can use (free + what its own workers
    # hold), so the second stage is no longer admitted (it used to be, then FREE_TOO_LOW).
    assert d.waiting[next(n for n in intents if n not in d.wake)][0].reason is (
        BlockReason.MEMORY_CLAIMED
    )


def test_deepening_sleep_does_not_gate_wakes() -> None:
    intents = {
        "a": StageIntent("a", False, sleep_level=2),
        "b": StageIntent("b", True, vram_request=GI),
    }
    facts = {
        "a": StageFacts(WorkerPhase.ASLEEP, level=1),
        "b": StageFacts(WorkerPhase.ASLEEP, level=1),
    }
    d = plan(intents, facts, GroupMemory(4 * GI, 4 * GI))
    assert d.sleep == (SleepOrder("a", 2, False),)
    assert d.holder_sleeps == frozenset()
    assert d.wake == ("b",)


def test_admission_counts_only_the_memory_the_group_can_use() -> None:
    """Driver reserve, contexts and other processes are not the group's: a co-tenant lower in
    order is not admitted beside a stage that then could never wake (issue 14: it used to be
    admitted against the total, and the first stage waited forever)."""
    intents = {
        "big": StageIntent("big", True, requested_active_at=2, vram_request=8 * GI),
        "small": StageIntent("small", True, requested_active_at=1),
    }
    facts = {
        "big": StageFacts(WorkerPhase.ASLEEP, 1, used_bytes=612 * MI, context_bytes=612 * MI),
        "small": StageFacts(WorkerPhase.ACTIVE, used_bytes=GI + 612 * MI,
                            active_footprint=GI + 612 * MI, context_bytes=612 * MI),
    }  # fmt: skip
    # 11 GiB device; reserve and two contexts leave ~8.7 GiB for the group, 7.7 GiB free.
    mem = GroupMemory(11 * GI, 7 * GI + 700 * MI)
    assert usable_memory(intents, facts, mem) == 8 * GI + 700 * MI
    d = plan(intents, facts, mem)
    assert d.admitted == ("big",) and d.sleep == (SleepOrder("small", 1, True),)
    # An unreachable worker's memory is unknown: admission falls back to the capacity.
    facts["small"] = StageFacts(WorkerPhase.UNREACHABLE)
    assert usable_memory(intents, facts, mem) is None


def test_steady_state_orders_nothing() -> None:
    intents = {
        "a": StageIntent("a", True, requested_active_at=1),
        "b": StageIntent("b", False),
    }
    facts = {"a": ACTIVE, "b": ASLEEP}
    d = plan(intents, facts, GroupMemory(10 * GI, 4 * GI))
    assert (d.admitted, d.sleep, d.wake) == (("a",), (), ())


def test_transition_in_progress_is_awaited_not_raced() -> None:
    intents = {
        "a": StageIntent("a", False),
        "b": StageIntent("b", True, vram_request=GI),
    }
    for phase in (WorkerPhase.LOADING, WorkerPhase.SLEEPING, WorkerPhase.WAKING):
        facts = {"a": StageFacts(phase), "b": StageFacts(WorkerPhase.ASLEEP, level=1)}
        d = plan(intents, facts, GroupMemory(4 * GI, 4 * GI))
        assert d.sleep == ()
        assert d.wake == ()
        assert d.waiting["b"][0].reason is BlockReason.MUST_SLEEP


def test_sleep_order_carries_the_drain_timeout_and_inflight_requests() -> None:
    intents = {
        "a": StageIntent("a", False, drain_timeout_s=900.0),
        "b": StageIntent("b", True, vram_request=GI),
    }
    facts = {
        "a": StageFacts(WorkerPhase.ACTIVE, used_bytes=GI, inflight_requests=2),
        "b": StageFacts(WorkerPhase.ASLEEP, level=1),
    }
    d = plan(intents, facts, GroupMemory(4 * GI, 3 * GI))
    assert d.sleep == (SleepOrder("a", 1, True, drain_timeout_s=900.0, inflight_requests=2),)
