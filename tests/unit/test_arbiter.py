"""Examples of the group arbiter's rules (property-based tests: test_handover_stateful)."""

from __future__ import annotations

from omnistage_operator.decisions.arbiter import (
    DEFAULT_CONTEXT_BYTES,
    BlockReason,
    DeviceMemory,
    FenceOrder,
    GroupMemory,
    Handover,
    SleepOrder,
    StageFacts,
    StageIntent,
    WorkerPhase,
)
from omnistage_operator.decisions.arbiter.admission import admission_order
from omnistage_operator.decisions.arbiter.demand import (
    context_charge,
    footprint,
    may_hold_memory,
    usable_memory,
)
from omnistage_operator.decisions.arbiter.gate import device_mismatches
from omnistage_operator.decisions.arbiter.plan import plan

GI = 1 << 30
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


# --- issue 14: the promise on real GPU physics -------------------------------------------------

MI = 1 << 20


def test_stage_without_request_wakes_when_the_others_hold_nothing() -> None:
    """Real GPU: free is below total (driver reserve, contexts). A stage with neither a request
    nor a measurement wakes once no other stage may hold memory (it used to need free >=
    capacity, which never holds on a GPU)."""
    intents = {"a": StageIntent("a", True), "b": StageIntent("b", False)}
    facts = {
        "a": StageFacts(WorkerPhase.ASLEEP, level=1, context_bytes=612 * MI),
        "b": StageFacts(WorkerPhase.ASLEEP, level=1, context_bytes=612 * MI),
    }
    mem = GroupMemory(80 * GI, 78 * GI + 800 * MI)
    d = plan(intents, facts, mem, margin_bytes=64 * MI)
    assert d.admitted == ("a",) and d.wake == ("a",)
    assert d.footprints["a"] is None

    # While another stage may hold memory, the stage of unknown need waits for it.
    facts["b"] = StageFacts(WorkerPhase.ACTIVE, used_bytes=GI)
    d = plan(intents, facts, mem, margin_bytes=64 * MI)
    assert d.wake == () and d.waiting_for("a") == ("b",)
    assert d.sleep == (SleepOrder("b", 1, True),)


def test_unknown_footprint_is_admitted_alone_and_first_only() -> None:
    intents = {
        "a": StageIntent("a", True, requested_active_at=2),
        "b": StageIntent("b", True, requested_active_at=1, vram_request=GI),
    }
    facts = {n: StageFacts(WorkerPhase.ASLEEP, level=1) for n in intents}
    d = plan(intents, facts, GroupMemory(80 * GI, 79 * GI))
    assert d.admitted == ("a",) and d.waiting_for("b") == ("a",)
    # Behind a known stage, an unknown one is not admitted even with room left.
    intents["b"] = StageIntent("b", True, requested_active_at=3, vram_request=GI)
    d = plan(intents, facts, GroupMemory(80 * GI, 79 * GI))
    assert d.admitted == ("b",) and d.waiting_for("a") == ("b",)


def test_footprint_is_the_largest_of_request_peak_active_and_learned_need() -> None:
    """The peak while serving counts: it used to be replaced by the weights-only footprint, so
    two stages were admitted together and ran out of memory under load."""
    intents = {
        "a": StageIntent("a", True, requested_active_at=2, vram_request=10 * GI),
        "b": StageIntent("b", True, requested_active_at=1, vram_request=10 * GI),
    }
    facts = {
        "a": StageFacts(WorkerPhase.ASLEEP, 1, active_footprint=9 * GI, peak_active=20 * GI),
        "b": StageFacts(WorkerPhase.ASLEEP, 1, active_footprint=9 * GI, peak_active=20 * GI),
    }
    d = plan(intents, facts, GroupMemory(32 * GI, 31 * GI))
    assert d.footprints == {"a": 20 * GI, "b": 20 * GI}
    assert d.admitted == ("a",)
    assert footprint(intents["a"], StageFacts(WorkerPhase.ASLEEP, learned_need=40 * GI)) == (
        40 * GI
    )
    assert footprint(StageIntent("x", True), StageFacts(WorkerPhase.ASLEEP)) is None


def test_learned_need_larger_than_the_device_is_larger_than_device() -> None:
    intents = {"a": StageIntent("a", True)}
    facts = {"a": StageFacts(WorkerPhase.ASLEEP, level=1, learned_need=90 * GI)}
    d = plan(intents, facts, GroupMemory(80 * GI, 79 * GI))
    assert d.admitted == () and d.wake == ()
    assert d.waiting["a"][0].reason is BlockReason.TOO_LARGE
    assert BlockReason.TOO_LARGE.value == "LargerThanDevice"


def test_failed_worker_holds_memory_and_is_fenced_not_admitted() -> None:
    intents = {"a": StageIntent("a", True, requested_active_at=2), "b": StageIntent("b", True)}
    failed = StageFacts(WorkerPhase.FAILED, used_bytes=6 * GI)
    assert may_hold_memory(failed)
    facts = {"a": failed, "b": StageFacts(WorkerPhase.ASLEEP, level=1)}
    d = plan(intents, facts, GroupMemory(10 * GI, 4 * GI))
    assert d.admitted == ("b",)
    assert [(f.stage, f.reason) for f in d.fence] == [("a", BlockReason.WORKER_FAILED)]
    assert d.sleep == () and d.wake == ()
    assert d.waiting_for("b") == ("a",)


def test_pending_fence_holds_memory_across_rounds_until_the_pod_is_gone() -> None:
    """A fence started and not confirmed (persisted in status) keeps the gate closed in every
    later round, whatever the worker says, and the fence is ordered again."""
    intents = {"a": StageIntent("a", False), "b": StageIntent("b", True, vram_request=GI)}
    for phase in (WorkerPhase.ASLEEP, WorkerPhase.STARTING, WorkerPhase.UNREACHABLE):
        a = StageFacts(phase, level=1, fence_pending=True)
        assert may_hold_memory(a)
        d = plan(intents, {"a": a, "b": StageFacts(WorkerPhase.ASLEEP, level=1)},
                 GroupMemory(10 * GI, 10 * GI))  # fmt: skip
        assert d.wake == ()
        assert d.fence == (FenceOrder("a", BlockReason.FENCE_PENDING, d.fence[0].message),)
        assert d.waiting["b"][0].reason is BlockReason.FENCE_PENDING
    gone = StageFacts(WorkerPhase.ABSENT, fence_pending=True)  # the API confirmed it gone
    assert not may_hold_memory(gone)
    d = plan(intents, {"a": gone, "b": StageFacts(WorkerPhase.ASLEEP, level=1)},
             GroupMemory(10 * GI, 10 * GI))  # fmt: skip
    assert d.wake == ("b",) and d.fence == ()


def test_contradicted_sleep_ack_holds_memory_and_is_fenced() -> None:
    intents = {"a": StageIntent("a", False), "b": StageIntent("b", True, vram_request=GI)}
    liar = StageFacts(WorkerPhase.ASLEEP, level=1, ack_contradicted="claims 6Gi, device 0")
    assert may_hold_memory(liar)
    d = plan(intents, {"a": liar, "b": StageFacts(WorkerPhase.ASLEEP, level=1)},
             GroupMemory(10 * GI, 10 * GI))  # fmt: skip
    assert d.wake == () and [f.reason for f in d.fence] == [BlockReason.ACK_CONTRADICTED]


def test_starting_pods_are_charged_their_context() -> None:
    intents = {
        "a": StageIntent("a", True, vram_request=9 * GI),
        "b": StageIntent("b", False),
        "c": StageIntent("c", False),
    }
    facts = {
        "a": StageFacts(WorkerPhase.ASLEEP, level=1),
        "b": StageFacts(WorkerPhase.STARTING),
        "c": StageFacts(WorkerPhase.ABSENT),
    }
    # 9.5 GiB free: 9 GiB fit, but not with a 612 MiB context of the starting pod b.
    mem = GroupMemory(
        10 * GI, 9 * GI + 512 * MI, (DeviceMemory("GPU-0", 10 * GI, 9 * GI + 512 * MI),)
    )
    d = plan(intents, facts, mem)
    assert d.wake == ()
    assert d.waiting["a"][0].reason is BlockReason.FREE_TOO_LOW
    assert "starting contexts" in d.waiting["a"][0].message
    assert context_charge(facts) == DEFAULT_CONTEXT_BYTES == 612 * MI
    # A context measured by a worker of the group replaces the default.
    facts["a"] = StageFacts(WorkerPhase.ASLEEP, level=1, context_bytes=256 * MI)
    assert context_charge(facts) == 256 * MI
    assert plan(intents, facts, mem).wake == ("a",)
    # On a host-accounting device (no GPU UUIDs) processes take no CUDA context.
    facts["a"] = StageFacts(WorkerPhase.ASLEEP, level=1)
    assert context_charge(facts, gpu=False) == 0
    assert plan(intents, facts, GroupMemory(10 * GI, 9 * GI + 512 * MI)).wake == ("a",)


def test_no_wake_in_a_round_that_started_pods() -> None:
    intents = {"a": StageIntent("a", True, vram_request=GI), "b": StageIntent("b", False)}
    facts = {"a": StageFacts(WorkerPhase.ASLEEP, level=1), "b": StageFacts(WorkerPhase.STARTING)}
    mem = GroupMemory(10 * GI, 9 * GI)
    assert plan(intents, facts, mem).wake == ("a",)
    d = plan(intents, facts, mem, started=frozenset({"b"}))
    assert d.wake == () and d.waiting["a"][0].reason is BlockReason.PODS_STARTING


def test_wake_gate_fails_closed_without_free_figures() -> None:
    intents = {"a": StageIntent("a", True, vram_request=GI)}
    facts = {"a": StageFacts(WorkerPhase.ASLEEP, level=1)}
    d = plan(intents, facts, GroupMemory(10 * GI, None))
    assert d.wake == () and d.waiting["a"][0].reason is BlockReason.NOT_MEASURED


def test_gate_checks_every_device() -> None:
    intents = {"a": StageIntent("a", True, vram_request=8 * GI, gpus=2)}
    facts = {"a": StageFacts(WorkerPhase.ASLEEP, level=1)}
    devs = (DeviceMemory("GPU-0", 80 * GI, 70 * GI), DeviceMemory("GPU-1", 80 * GI, 3 * GI))
    d = plan(intents, facts, GroupMemory(80 * GI, 3 * GI, devs))
    assert d.wake == () and "GPU-1" in d.waiting["a"][0].message  # 4 GiB per device needed
    devs = (DeviceMemory("GPU-0", 80 * GI, 70 * GI), DeviceMemory("GPU-1", 80 * GI, 5 * GI))
    assert plan(intents, facts, GroupMemory(80 * GI, 5 * GI, devs)).wake == ("a",)


def test_cpu_stage_in_a_gpu_group_neither_gates_nor_is_gated() -> None:
    intents = {
        "gpu": StageIntent("gpu", True, vram_request=8 * GI),
        "cpu": StageIntent("cpu", True, gpus=0, requested_active_at=5),
    }
    facts = {
        "gpu": StageFacts(WorkerPhase.ASLEEP, level=1),
        "cpu": StageFacts(WorkerPhase.ACTIVE, used_bytes=100 * GI),
    }
    devs = (DeviceMemory("GPU-0", 10 * GI, 9 * GI),)
    d = plan(intents, facts, GroupMemory(10 * GI, 9 * GI, devs))
    assert set(d.admitted) == {"gpu", "cpu"} and d.wake == ("gpu",)


def test_device_mismatch_blocks_every_wake() -> None:
    intents = {"a": StageIntent("a", True, vram_request=GI), "b": StageIntent("b", False)}
    facts = {
        "a": StageFacts(WorkerPhase.ASLEEP, level=1, device_uuids=("GPU-0",)),
        "b": StageFacts(WorkerPhase.ASLEEP, level=1, device_uuids=("GPU-0", "GPU-1")),
    }
    devs = (DeviceMemory("GPU-0", 10 * GI, 9 * GI),)
    ok = GroupMemory(10 * GI, 9 * GI, devs, claim_uuids=("GPU-0",))
    d = plan(intents, facts, ok)
    assert d.wake == ()
    assert [(b.reason, b.stage) for b in d.waiting["a"]] == [(BlockReason.DEVICE_MISMATCH, "b")]
    facts["b"] = StageFacts(WorkerPhase.ASLEEP, level=1, device_uuids=("GPU-0",))
    assert plan(intents, facts, ok).wake == ("a",)
    # Without a claim (explicit placement) the workers must agree with each other.
    facts["b"] = StageFacts(WorkerPhase.ASLEEP, level=1, device_uuids=("GPU-7",))
    assert device_mismatches(None, facts) != ()


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


def test_each_device_of_a_stage_must_fit_and_only_its_devices_are_charged() -> None:
    # A 2-GPU claim: two 1-GPU stages on different devices fit side by side; a 2-GPU stage
    # needs both devices and is charged on both.
    devs = (DeviceMemory("GPU-0", 10 * GI, 9 * GI), DeviceMemory("GPU-1", 10 * GI, 9 * GI))
    memory = GroupMemory(10 * GI, 9 * GI, devs, claim_uuids=("GPU-0", "GPU-1"))
    on0 = StageFacts(WorkerPhase.ASLEEP, level=1, device_uuids=("GPU-0",))
    on1 = StageFacts(WorkerPhase.ASLEEP, level=1, device_uuids=("GPU-1",))
    both = StageFacts(WorkerPhase.ASLEEP, level=1, device_uuids=("GPU-0", "GPU-1"))
    intents = {
        "a": StageIntent("a", True, priority=2, vram_request=6 * GI, gpus=1),
        "b": StageIntent("b", True, priority=1, vram_request=6 * GI, gpus=1),
    }
    d = plan(intents, {"a": on0, "b": on1}, memory)
    assert set(d.admitted) == {"a", "b"} and set(d.wake) == {"a", "b"}
    # on the same device they do not both fit (6 + 6 > 9)
    d = plan(intents, {"a": on0, "b": on0}, memory)
    assert d.admitted == ("a",) and d.wake == ("a",)
    assert "left on GPU-0" in d.waiting["b"][0].message
    # a 2-GPU stage (12 GiB: 6 per device) beside a 1-GPU stage holding 6 GiB on GPU-1
    intents = {
        "big": StageIntent("big", True, priority=1, vram_request=12 * GI, gpus=2),
        "small": StageIntent("small", True, priority=2, vram_request=6 * GI, gpus=1),
    }
    d = plan(intents, {"big": both, "small": on1}, memory)
    assert d.admitted == ("small",)  # GPU-1 has 3 GiB left: big does not fit there
    assert "GPU-1" in d.waiting["big"][0].message
    small_3 = {**intents, "small": StageIntent("small", True, priority=2, vram_request=3 * GI)}
    d = plan(small_3, {"big": both, "small": on1}, memory)
    assert set(d.admitted) == {"big", "small"}  # 6 <= 9 on GPU-0, 6 <= 6 on GPU-1
    # the wake gate charges the wakes on their own devices only
    assert set(d.wake) == {"big", "small"}


def test_the_gate_checks_only_the_stages_devices() -> None:
    devs = (DeviceMemory("GPU-0", 10 * GI, 9 * GI), DeviceMemory("GPU-1", 10 * GI, GI))
    memory = GroupMemory(10 * GI, GI, devs, claim_uuids=("GPU-0", "GPU-1"))
    intents = {"a": StageIntent("a", True, vram_request=6 * GI, gpus=1)}
    on0 = StageFacts(WorkerPhase.ASLEEP, level=1, device_uuids=("GPU-0",))
    assert plan(intents, {"a": on0}, memory).wake == ("a",)  # GPU-1's 1 GiB is not its concern
    on1 = StageFacts(WorkerPhase.ASLEEP, level=1, device_uuids=("GPU-1",))
    d = plan(intents, {"a": on1}, memory)
    assert d.wake == () and "GPU-1" in d.waiting["a"][0].message
    # devices not reported yet: every device of the group is charged (safe)
    d = plan(intents, {"a": StageFacts(WorkerPhase.ASLEEP, level=1)}, memory)
    assert d.wake == ()


def test_a_stage_needing_more_gpus_than_the_claim_is_refused() -> None:
    devs = (DeviceMemory("GPU-0", 10 * GI, 9 * GI),)
    memory = GroupMemory(10 * GI, 9 * GI, devs, claim_uuids=("GPU-0",))
    intents = {"wide": StageIntent("wide", True, vram_request=GI, gpus=2)}
    d = plan(intents, {"wide": StageFacts(WorkerPhase.ASLEEP, level=1)}, memory)
    assert d.admitted == () and d.wake == ()
    (blocker,) = d.waiting["wide"]
    assert blocker.reason is BlockReason.CLAIM_TOO_SMALL
    assert blocker.message.startswith("needs 2 GPUs; the group's claim holds 1")
    # a stage not loaded yet (no pod: the operator starts none for it) reads the same
    idle = {"wide": StageIntent("wide", False, vram_request=GI, gpus=2)}
    d = plan(idle, {"wide": StageFacts(WorkerPhase.ABSENT)}, memory)
    assert [b.reason for b in d.waiting["wide"]] == [BlockReason.CLAIM_TOO_SMALL]


def test_a_stage_on_fewer_gpus_uses_some_of_the_claims_devices() -> None:
    facts = {
        "one": StageFacts(WorkerPhase.ASLEEP, level=1, device_uuids=("GPU-0",)),
        "two": StageFacts(WorkerPhase.ASLEEP, level=1, device_uuids=("GPU-0", "GPU-1")),
    }
    assert device_mismatches(("GPU-0", "GPU-1"), facts) == ()
    assert device_mismatches(None, facts) == ()
    facts["one"] = StageFacts(WorkerPhase.ASLEEP, level=1, device_uuids=("GPU-7",))
    assert [b.stage for b in device_mismatches(("GPU-0", "GPU-1"), facts)] == ["one"]
