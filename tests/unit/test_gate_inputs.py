"""What the gate is fed (issue 19 items 1-3, issue 18's honest peaks): per-device ACK checks,
per-device footprints and holders, peaks kept across wakes, and a reason on every wait."""

from __future__ import annotations

from datetime import UTC, datetime

from hypothesis import given, settings
from hypothesis import strategies as st

from omnistage_operator.decisions.arbiter import (
    BlockReason,
    DeviceMemory,
    GroupMemory,
    Handover,
    StageFacts,
    StageIntent,
    WorkerPhase,
)
from omnistage_operator.decisions.arbiter.footprints import OTHER_TENANTS, device_need
from omnistage_operator.decisions.arbiter.plan import plan
from omnistage_operator.decisions.facts import (
    AckFacts,
    DeviceFigures,
    WorkerReport,
    ack_contradiction,
)
from omnistage_operator.decisions.peaks import StagePeaks, from_status, to_status
from omnistage_operator.decisions.status import StageObservation, build_status, wait_cause
from omnistage_worker.quantities import format_bytes

GI = 1 << 30
MI = 1 << 20
NOW = datetime(2026, 11, 24, 9, 0, tzinfo=UTC)


def _dev(uuid: str, *figures: int, total: int = 80 * GI) -> DeviceFigures:
    """One device's ACK figures: used before, used after, free before, free after."""
    used_before, used_after, free_before, free_after = figures
    return DeviceFigures(uuid, 0, total, used_before, used_after, free_before, free_after)


def _sleep(*devices: DeviceFigures, state: WorkerPhase = WorkerPhase.ASLEEP) -> AckFacts:
    freed = sum(d.used_before - d.used_after for d in devices)
    return AckFacts(
        "t1", True, "sleep", state, level=1, freed_bytes=freed, devices=devices,
        free_before_bytes=sum(d.free_before for d in devices),
        free_after_bytes=sum(d.free_after for d in devices),
        total_bytes=sum(d.total for d in devices),
    )  # fmt: skip


# -- 2. an ACK is checked against the device, per device ------------------------------------


def test_a_lie_on_one_device_is_caught_even_when_the_sums_agree() -> None:
    # GPU-a: 10 GiB freed and 16 GiB gained (another sleeper freed 6 GiB there meanwhile);
    # GPU-b: 6 GiB claimed and nothing gained. Summed, claim 16 = gain 16: the old check passed.
    ack = _sleep(
        _dev("GPU-a", 10 * GI + 600 * MI, 600 * MI, 20 * GI, 36 * GI),
        _dev("GPU-b", 6 * GI + 600 * MI, 600 * MI, 20 * GI, 20 * GI),
    )
    why = ack_contradiction(ack)
    assert why is not None and "GPU-b" in why and "GPU-a" not in why
    assert f"gained 0 bytes (tolerance {int(0.02 * 80 * GI)})" in why


def test_freed_zero_is_judged_against_what_the_operator_saw_it_hold() -> None:
    # NVML stopped listing the worker: its ACK says 0 before, 0 after, ok, freed 0; the device
    # gained nothing, but the operator saw it hold 12 GiB there since its last wake.
    ack = _sleep(_dev("GPU-a", 0, 0, 20 * GI, 20 * GI))
    assert ack.freed_bytes == 0
    why = ack_contradiction(ack, held={"GPU-a": 12 * GI})
    assert why is not None and "seen by the operator" in why and str(12 * GI) in why
    # The same ACK with the 12 GiB showing up in the device's free memory is trusted.
    honest = _sleep(_dev("GPU-a", 0, 0, 20 * GI, 32 * GI))
    assert ack_contradiction(honest, held={"GPU-a": 12 * GI}) is None


def test_ok_with_its_memory_still_on_the_device_is_contradicted() -> None:
    # Freed 0, ok, and its own figure says it still holds 12 GiB asleep (context 600 MiB).
    ack = _sleep(_dev("GPU-a", 12 * GI, 12 * GI, 20 * GI, 20 * GI))
    why = ack_contradiction(ack, context_bytes=600 * MI)
    assert why is not None and "still holds" in why
    # A component sleep (the worker stays Active) keeps memory by design: not judged so.
    parts = _sleep(_dev("GPU-a", 12 * GI, 8 * GI, 20 * GI, 24 * GI), state=WorkerPhase.ACTIVE)
    assert ack_contradiction(parts, context_bytes=600 * MI) is None


def test_real_noise_within_the_tolerance_is_trusted() -> None:
    # 16 GiB freed, the device gained 16 GiB less 1 GiB of allocator slack elsewhere: within 2%.
    ack = _sleep(_dev("GPU-a", 16 * GI + 600 * MI, 600 * MI, 10 * GI, 25 * GI))
    assert (
        ack_contradiction(ack, held={"GPU-a": 16 * GI + 600 * MI}, context_bytes=600 * MI) is None
    )


def test_what_was_seen_held_goes_with_the_sleep_order_not_into_later_acks() -> None:
    active = WorkerReport(
        WorkerPhase.ACTIVE, used_bytes=12 * GI, context_bytes=600 * MI,
        devices=(DeviceFigures("GPU-a", 0, 80 * GI, 12 * GI, 12 * GI, 20 * GI, 20 * GI),),
    )  # fmt: skip
    peaks = StagePeaks().seen(active, "uid-1")
    facts = active.stage_facts(device_held=peaks.since_wake)
    d = plan({"a": StageIntent("a", False)}, {"a": facts}, GroupMemory(80 * GI, 20 * GI))
    (order,) = d.sleep
    assert order.held == {"GPU-a": 12 * GI} and order.context_bytes == 600 * MI
    # Asleep, its later 1->2 deepening frees no device memory: what it held before its sleep
    # is not asked of that ACK (the sleep's own ACK was judged when it came).
    deeper = _sleep(_dev("GPU-a", 600 * MI, 600 * MI, 32 * GI, 32 * GI))
    asleep = WorkerReport(WorkerPhase.ASLEEP, level=2, last_ack=deeper, context_bytes=600 * MI)
    assert asleep.stage_facts(device_held=peaks.since_wake).ack_contradicted is None
    # A new pod of the stage starts what it was seen holding anew.
    assert StagePeaks().seen(active, "uid-1").seen(asleep, "uid-2").since_wake == {}


# -- 3. per-device footprints ---------------------------------------------------------------


def _two_gpus(free_a: int, free_b: int) -> GroupMemory:
    devices = (DeviceMemory("GPU-a", 16 * GI, free_a), DeviceMemory("GPU-b", 16 * GI, free_b))
    return GroupMemory(16 * GI, min(free_a, free_b), devices)


def test_an_uneven_split_is_not_woken_where_its_heavy_side_does_not_fit() -> None:
    # A pipeline over two GPUs: 9 GiB on GPU-a (transformer), 3 GiB on GPU-b (encoders, VAE).
    # Free: 7 GiB on a, 12 GiB on b: 19 GiB free for a 12 GiB stage, and footprint/2 = 6 GiB
    # fits both, but its heavy side does not fit GPU-a.
    intents = {"pipe": StageIntent("pipe", True, gpus=2)}
    asleep = StageFacts(
        WorkerPhase.ASLEEP, level=1, used_bytes=GI, peak_active=12 * GI,
        device_uuids=("GPU-a", "GPU-b"), device_peaks={"GPU-a": 9 * GI, "GPU-b": 3 * GI},
    )  # fmt: skip
    d = plan(intents, {"pipe": asleep}, _two_gpus(7 * GI, 12 * GI))
    assert d.wake == ()
    (blocker,) = d.waiting["pipe"]
    assert blocker.reason is BlockReason.FREE_TOO_LOW and blocker.device == "GPU-a"
    assert blocker.needed == 9 * GI and blocker.free == 7 * GI
    # With the room on GPU-a it wakes, though GPU-b has less free than footprint/2 there.
    assert plan(intents, {"pipe": asleep}, _two_gpus(10 * GI, 4 * GI)).wake == ("pipe",)


def test_a_stage_never_measured_uses_its_loaders_byte_map() -> None:
    intents = {"pipe": StageIntent("pipe", True, gpus=2)}
    fresh = StageFacts(
        WorkerPhase.ASLEEP, level=1, context_bytes=GI, device_uuids=("GPU-a", "GPU-b"),
        device_weights={"GPU-a": 9 * GI, "GPU-b": 3 * GI},
    )  # fmt: skip
    mem = _two_gpus(8 * GI, 15 * GI)
    need = device_need(intents["pipe"], fresh, mem, ("GPU-a", "GPU-b"), None)
    assert need == {"GPU-a": 9 * GI + GI // 2, "GPU-b": 3 * GI + GI // 2}
    assert plan(intents, {"pipe": fresh}, mem).wake == ()
    assert plan(intents, {"pipe": fresh}, _two_gpus(10 * GI, 4 * GI)).wake == ("pipe",)


@settings(max_examples=200, deadline=None)
@given(
    a=st.integers(0, 40 * GI),
    b=st.integers(0, 40 * GI),
    total=st.one_of(st.none(), st.integers(0, 80 * GI)),
)
def test_a_need_never_undercharges_a_device_or_the_total(a: int, b: int, total: int | None) -> None:
    intent = StageIntent("s", True, gpus=2)
    fact = StageFacts(WorkerPhase.ASLEEP, device_peaks={"GPU-a": a, "GPU-b": b})
    need = device_need(intent, fact, _two_gpus(GI, GI), ("GPU-a", "GPU-b"), total)
    if not (a or b) and total is None:
        assert need is None
        return
    assert need is not None
    assert need["GPU-a"] >= a and need["GPU-b"] >= b
    assert sum(need.values()) >= (total or 0)


# -- 4. honest peaks ------------------------------------------------------------------------


def test_the_peak_under_load_is_kept_across_a_wake_and_persisted() -> None:
    active = WorkerReport(
        WorkerPhase.ACTIVE, used_bytes=14 * GI, peak_active_bytes=20 * GI,
        devices=(DeviceFigures("GPU-a", 0, 80 * GI, 14 * GI, 14 * GI, 60 * GI, 60 * GI),),
    )  # fmt: skip
    peaks = StagePeaks().seen(active)
    assert peaks.kept == {"GPU-a": 20 * GI}  # the worker's own peak (activations) counts
    slept = _sleep(_dev("GPU-a", 15 * GI, 600 * MI, 60 * GI, 74 * GI))
    woke = AckFacts(
        "t2", True, "wake", WorkerPhase.ACTIVE, devices=(_dev("GPU-a", 600 * MI, 13 * GI, 74 * GI,
        62 * GI),), peak_active_bytes=0,
    )  # fmt: skip
    peaks = peaks.acked(slept).acked(woke)
    assert peaks.kept == {"GPU-a": 20 * GI}  # a wake does not reset it toward the weights
    assert peaks.since_wake == {"GPU-a": 13 * GI}
    back = from_status({"memory": {"peak": to_status(peaks)}})
    assert back is not None and back.kept == {"GPU-a": 20 * GI}
    # And admission charges it: a fresh pod of the stage (weights 13 GiB) needs 20 GiB there.
    facts = WorkerReport(
        WorkerPhase.ASLEEP, level=1, devices=(DeviceFigures("GPU-a", 0, 80 * GI, GI, GI, 70 * GI,
        70 * GI),), peak_active_bytes=13 * GI,
    ).stage_facts(device_peaks=back.kept)  # fmt: skip
    mem = GroupMemory(80 * GI, 18 * GI, (DeviceMemory("GPU-a", 80 * GI, 18 * GI),))
    d = plan({"s": StageIntent("s", True)}, {"s": facts}, mem)
    assert d.wake == () and d.waiting["s"][0].needed == 20 * GI


# -- 1. every wait has a reason -------------------------------------------------------------


def test_a_wait_for_memory_names_the_device_the_figures_and_the_other_tenants() -> None:
    # Both stages asleep, another tenant holds most of the device; llm (16 GiB) wants Active.
    dev = DeviceMemory("GPU-a", 80 * GI, 7 * GI)
    mem = GroupMemory(80 * GI, 7 * GI, (dev,))

    def asleep(peak: int) -> StageFacts:
        return StageFacts(
            WorkerPhase.ASLEEP, level=1, used_bytes=600 * MI, context_bytes=600 * MI,
            peak_active=peak, device_uuids=("GPU-a",), device_used={"GPU-a": 600 * MI},
        )  # fmt: skip

    intents = {"llm": StageIntent("llm", True), "sd": StageIntent("sd", False)}
    facts = {"llm": asleep(16 * GI), "sd": asleep(13 * GI)}
    d = plan(intents, facts, mem, Handover("h", frozenset(), frozenset()))
    assert d.admitted == ("llm",) and d.wake == ()
    rep = WorkerReport(WorkerPhase.ASLEEP, level=1, used_bytes=600 * MI, total_bytes=80 * GI)
    obs = StageObservation(
        1, True, WorkerPhase.ASLEEP, report=rep, admitted=True, waiting=d.waiting["llm"]
    )
    status = build_status(obs, None, NOW)
    assert status["state"] == "Waiting" and status["waitReason"] == "InsufficientMemory"
    tenants = 80 * GI - 7 * GI - 2 * 600 * MI
    assert status["waitingFor"][0] == (
        f"{OTHER_TENANTS}: {format_bytes(tenants)} on GPU-a (free 7Gi, needed 16Gi)"
    ), status["waitingFor"]
    assert status["waitingFor"][1] == "sd: 600Mi on GPU-a (free 7Gi, needed 16Gi)"
    admitted = next(c for c in status["conditions"] if c["type"] == "Admitted")
    assert (admitted["status"], admitted["reason"]) == ("False", "InsufficientMemory")
    assert "measured free 7Gi on GPU-a" in admitted["message"]
    # The Event key moves with the cause, not with the figures.
    moved = dict(status, waitingFor=[e.replace("7Gi", "6.9Gi") for e in status["waitingFor"]])
    assert wait_cause(moved) == wait_cause(status) == ("InsufficientMemory", OTHER_TENANTS, "sd")


@settings(max_examples=300, deadline=None)
@given(
    weights=st.integers(0, 30 * GI),
    context=st.integers(300 * MI, 700 * MI),
    noise=st.integers(-int(0.02 * 80 * GI), int(0.02 * 80 * GI)),
    hidden=st.integers(0, 30 * GI),
)
def test_an_ack_is_contradicted_exactly_when_the_device_misses_more_than_the_tolerance(
    weights: int, context: int, noise: int, hidden: int
) -> None:
    """Per device: what left by the ACK's figures, less what the device's free memory gained
    (noise from other processes, ``hidden`` bytes a liar kept), beyond max(2%, 256 MiB)."""
    tolerance = max(int(0.02 * 80 * GI), 256 * MI)
    kept = min(hidden, weights)
    gain = weights - kept + noise
    ack = _sleep(_dev("GPU-a", context + weights, context, 10 * GI, 10 * GI + gain))
    why = ack_contradiction(ack, context_bytes=context)
    assert (why is not None) == (kept - noise > tolerance)
