"""Which sleep carries a wake in an overlapped hand-over (``handover.overlap.pair_wake``): the
arbiter itself, asked with the sleeper already asleep, must wake exactly one stage on the same
single device and order nothing else; the wake's first limit is what it holds plus the measured
room beside the sleeper, less the margin. And how that sleep's ACK is judged against the device
(``facts.ack_contradiction`` with the wake beside it)."""

from __future__ import annotations

from dataclasses import replace

from omnistage_operator.decisions.arbiter import (
    DeviceMemory,
    GroupMemory,
    StageFacts,
    StageIntent,
    WorkerPhase,
)
from omnistage_operator.decisions.arbiter.plan import plan
from omnistage_operator.decisions.facts import (
    OVERLAPPED_SLEEP,
    AckFacts,
    DeviceFigures,
    ack_contradiction,
)
from omnistage_operator.decisions.handover import GroupObservation, RoundPolicy
from omnistage_operator.decisions.handover.overlap import Pairing, pair_wake

GI = 1 << 30
MI = 1 << 20
CTX = 600 * MI
GPU = "GPU-0"
POLICY = RoundPolicy(margin_bytes=64 * MI, overlapped=True)


def _active(used: int, uuids: tuple[str, ...] = (GPU,)) -> StageFacts:
    return StageFacts(
        WorkerPhase.ACTIVE, used_bytes=used, active_footprint=used, context_bytes=CTX,
        device_uuids=uuids, device_used=dict.fromkeys(uuids, used), claim_limits=True,
    )  # fmt: skip


def _asleep(uuids: tuple[str, ...] = (GPU,)) -> StageFacts:
    return StageFacts(
        WorkerPhase.ASLEEP, level=1, used_bytes=CTX, active_footprint=16 * GI,
        context_bytes=CTX, device_uuids=uuids, device_used=dict.fromkeys(uuids, CTX),
        claim_limits=True,
    )  # fmt: skip


def _handover(free: int = GI, **over: object) -> GroupObservation:
    """x (16 GiB Active) must give the 40 GiB device up to y (16 GiB asleep, asked last);
    ``free``: the room beside them."""
    intents = {
        "x": StageIntent("x", True, requested_active_at=1.0),
        "y": StageIntent("y", True, requested_active_at=2.0),
    }
    facts = {"x": _active(16 * GI + CTX), "y": _asleep()}
    memory = GroupMemory(20 * GI, free, (DeviceMemory(GPU, 20 * GI, free),), (GPU,))
    obs = GroupObservation(intents, facts, memory)
    return replace(obs, **over)  # type: ignore[arg-type]


def _pair(obs: GroupObservation, policy: RoundPolicy = POLICY) -> Pairing | None:
    decision = plan(obs.intents, obs.facts, obs.memory, margin_bytes=policy.margin_bytes)
    assert [o.stage for o in decision.sleep] == ["x"] and decision.wake == ()
    return pair_wake(obs, decision.sleep[0], None, policy)


def test_the_sleep_carries_the_wake_the_arbiter_orders_next() -> None:
    pairing = _pair(_handover(free=GI))
    assert pairing == Pairing("y", CTX + GI - 64 * MI)


def test_room_beside_the_sleeper_is_counted_less_the_margin() -> None:
    assert _pair(_handover(free=100 * MI)) == Pairing("y", CTX + 36 * MI)
    # 32 MiB beside: after x's sleep, y's 16 GiB and the margin would not fit
    assert _pair(_handover(free=32 * MI)) is None


def test_kept_readings_leave_the_room_beside_to_the_sleeps_own_reading() -> None:
    assert _pair(_handover(free=GI, kept=True)) == Pairing("y", CTX, room_from_stream=True)


def test_a_worker_that_cannot_take_part_goes_the_serial_way() -> None:
    """An older worker (no SleepStream, a WakeUp that would ignore the limit) or one whose
    engine does not take memory piece by piece says so in ``claim_limits``: no pairing."""
    for name in ("x", "y"):
        obs = _handover(free=GI)
        facts = {**obs.facts, name: replace(obs.facts[name], claim_limits=False)}
        assert _pair(replace(obs, facts=facts)) is None, name


def test_pieces_are_handed_over_only_when_both_workers_can() -> None:
    both = _handover(free=GI)
    both = replace(both, facts={k: replace(f, handoff=True) for k, f in both.facts.items()})
    assert _pair(both) == Pairing("y", CTX + GI - 64 * MI, handoff=True)
    for name in ("x", "y"):
        one = replace(both, facts={**both.facts, name: replace(both.facts[name], handoff=False)})
        assert _pair(one) == Pairing("y", CTX + GI - 64 * MI), name


def test_no_pairing_when_the_freed_memory_would_not_let_the_arbiter_wake() -> None:
    obs = _handover()
    big = replace(obs.intents["y"], vram_request=19 * GI)  # more than x's sleep gives
    assert _pair(replace(obs, intents={**obs.intents, "y": big})) is None


def test_vllm_stages_and_busy_sleepers_go_the_serial_way() -> None:
    obs = _handover()
    vllm = replace(obs.facts["y"], claim_limits=False)  # a vLLM worker reports none
    assert _pair(replace(obs, facts={**obs.facts, "y": vllm})) is None
    busy = replace(obs.facts["x"], inflight_requests=2)
    assert _pair(replace(obs, facts={**obs.facts, "x": busy})) is None
    no_context = replace(obs.facts["x"], context_bytes=None)
    assert _pair(replace(obs, facts={**obs.facts, "x": no_context})) is None


def test_a_wake_on_another_device_or_two_devices_is_not_carried() -> None:
    obs = _handover()
    two = ("GPU-0", "GPU-1")
    devs = (DeviceMemory("GPU-0", 20 * GI, GI), DeviceMemory("GPU-1", 20 * GI, GI))
    memory = GroupMemory(20 * GI, GI, devs, two)
    wide = GroupObservation(
        {**obs.intents, "x": replace(obs.intents["x"], gpus=2)},
        {"x": _active(16 * GI + CTX, two), "y": _asleep(two)},
        memory,
    )
    assert _pair(wide) is None


def test_a_sleep_that_lets_two_stages_wake_is_not_overlapped() -> None:
    obs = _handover()
    z = StageIntent("z", True, requested_active_at=3.0, vram_request=GI)
    z_facts = replace(_asleep(), active_footprint=GI)
    both = GroupObservation({**obs.intents, "z": z}, {**obs.facts, "z": z_facts}, obs.memory)
    one_fits = pair_wake(both, plan(both.intents, both.facts, both.memory).sleep[0], None, POLICY)
    assert one_fits is not None  # with 1 GiB beside, only one of them fits after x's sleep
    free = 2 * GI  # now both do: y and z wake after x
    devs = (DeviceMemory(GPU, 20 * GI, free),)
    both = replace(both, memory=GroupMemory(20 * GI, free, devs, (GPU,)))
    decision = plan(both.intents, both.facts, both.memory, margin_bytes=POLICY.margin_bytes)
    sleeps = [o for o in decision.sleep if o.stage == "x"]
    assert sleeps and pair_wake(both, sleeps[0], None, POLICY) is None


# -- the sleep's ACK judged against the wake that ran beside it -----------------------------


def _ack(op: str, task_id: str, *figures: int) -> AckFacts:
    """One device's ACK (used before, used after, free before, free after) on a 141 GiB GPU."""
    used_before, used_after, free_before, free_after = figures
    dev = DeviceFigures(GPU, 0, 141 * GI, used_before, used_after, free_before, free_after)
    state = WorkerPhase.ASLEEP if op == "sleep" else WorkerPhase.ACTIVE
    return AckFacts(
        task_id, True, op, state, level=1 if op == "sleep" else None,
        freed_bytes=used_before - used_after, devices=(dev,), total_bytes=141 * GI,
        used_before_bytes=used_before, used_after_bytes=used_after,
        free_before_bytes=free_before, free_after_bytes=free_after,
    )  # fmt: skip


# x frees 17 GiB while y, beside it, takes 16 GiB: the device's free memory rose by only 1 GiB
# between x's readings, and by 1.4 GiB from x's start to y's end (3.4 GiB of room before).
X_HONEST = _ack("sleep", "h-x-sleep1" + OVERLAPPED_SLEEP, 17 * GI + CTX, CTX, 3 * GI, 4 * GI)
Y_WOKE = _ack("wake", "h-y-wake-beside", CTX, 16 * GI + CTX, 4 * GI, 4 * GI + 400 * MI)


def test_the_device_gain_counts_what_the_wake_beside_took() -> None:
    # Judged alone (as a serial ACK is), the 17 GiB x claims never showed up: a contradiction.
    alone = ack_contradiction(X_HONEST, context_bytes=CTX)
    assert alone is not None and "gained 1073741824 bytes" in alone
    # With the wake beside it, both workers' figures add up.
    assert ack_contradiction(X_HONEST, context_bytes=CTX, beside=Y_WOKE) is None


def test_a_wake_that_ended_before_the_sleep_is_judged_to_the_sleeps_end() -> None:
    """A small wake fits in the room beside the sleeper and ends first: the device's gain runs
    to the sleep's own end (the workers' clocks say which ended last), not to the wake's."""
    x = _ack("sleep", "h-x-sleep1" + OVERLAPPED_SLEEP, 6 * GI + CTX, CTX, 1136 * MI, 6256 * MI)
    small = _ack("wake", "h-y-wake-beside", CTX, GI + CTX, 1392 * MI, 1392 * MI)
    x, small = replace(x, finished_at=20.0), replace(small, finished_at=10.0)
    assert ack_contradiction(x, context_bytes=CTX, beside=small) is None
    # a sleeper that kept 4 GiB of it is still caught
    kept = replace(x, devices=(replace(x.devices[0], free_after=2160 * MI),))
    why = ack_contradiction(kept, context_bytes=CTX, beside=small)
    assert why is not None and "with what the wake beside it took" in why
    # unstamped ACKs: the wake's end is taken as the later one (as before the clocks counted)
    assert ack_contradiction(replace(x, finished_at=0.0), context_bytes=CTX, beside=small)


def test_a_lying_sleeper_is_caught_even_beside_a_wake() -> None:
    # x claims 17 GiB freed but kept 10 GiB of it (its figure omits them): y could take only
    # 7 GiB of the room (a real GPU refuses the rest), and the device ends 10 GiB short.
    liar = _ack("sleep", "h-x-sleep1" + OVERLAPPED_SLEEP, 17 * GI + CTX, CTX, 3 * GI, 3 * GI)
    short = _ack("wake", "h-y-wake-beside", CTX, 7 * GI + CTX, 3 * GI, 3 * GI)
    why = ack_contradiction(liar, context_bytes=CTX, beside=short)
    assert why is not None and "to the end of the wake beside it" in why


def test_later_readings_of_an_overlapped_ack_judge_what_the_worker_holds() -> None:
    # A GetStatus after the hand-over carries x's ACK as its last: its device gain is not
    # judged again without the wake beside it, but what x holds asleep still is.
    assert ack_contradiction(X_HONEST, None, CTX, rejudged=True) is None
    serial = replace(X_HONEST, task_id="h-x-sleep1")
    assert ack_contradiction(serial, None, CTX, rejudged=True) is not None
    keeps = _ack("sleep", "h-x-sleep1" + OVERLAPPED_SLEEP, 17 * GI + CTX, 9 * GI, 3 * GI, 4 * GI)
    why = ack_contradiction(keeps, None, CTX, rejudged=True)
    assert why is not None and "still holds" in why
