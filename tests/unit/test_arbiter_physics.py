"""Examples of the group arbiter's promise on real GPU physics (issue 14): a driver reserve and
per-process contexts, footprints learned or unknown, memory held by failed, fenced or lying
workers, and a wake gate that fails closed."""

from __future__ import annotations

from omnistage_operator.decisions.arbiter import (
    DEFAULT_CONTEXT_BYTES,
    BlockReason,
    DeviceMemory,
    FenceOrder,
    GroupMemory,
    SleepOrder,
    StageFacts,
    StageIntent,
    WorkerPhase,
)
from omnistage_operator.decisions.arbiter.demand import context_charge, footprint, may_hold_memory
from omnistage_operator.decisions.arbiter.plan import plan

GI = 1 << 30
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
