"""The back-off after wakes that ran out of device memory, and what the condition says."""

from __future__ import annotations

from omnistage_operator.api.spec_parse import parse_stage
from omnistage_operator.decisions.arbiter import WorkerPhase
from omnistage_operator.decisions.facts import AckFacts, DeviceFigures
from omnistage_operator.decisions.remembered import adopt_status
from omnistage_operator.decisions.wake_backoff import (
    MAX_S,
    WakeBackoff,
    from_status,
    oom_message,
    to_status,
)
from tests.unit.test_spec import body

GI = 1 << 30


def test_back_off_doubles_up_to_its_bound() -> None:
    b = WakeBackoff()
    assert b.left(100.0) == 0.0
    lefts = []
    for _ in range(8):
        b = b.after_oom(100.0)
        lefts.append(b.left(100.0))
    assert lefts[:6] == [1.0, 2.0, 4.0, 8.0, 16.0, MAX_S] and lefts[-1] == MAX_S
    assert b.left(100.0 + MAX_S) == 0.0


def test_the_message_has_the_figures() -> None:
    dev = DeviceFigures("GPU-1", 0, 80 * GI, GI // 2, GI // 2, 7 * GI, 7 * GI)
    ack = AckFacts("h1-b-wake", False, "wake", WorkerPhase.ASLEEP, level=1, devices=(dev,),
                   free_after_bytes=7 * GI, needed_bytes=9 * GI)  # fmt: skip
    text = oom_message(ack, 17 * GI, WakeBackoff().after_oom(0.0), 0.0)
    assert f"needed {9 * GI} bytes more than the {7 * GI} free" in text
    assert f"device 0 (GPU-1): {7 * GI} free" in text
    assert f"charged {17 * GI} bytes" in text and "no wake for 1s" in text


def test_the_back_off_survives_status_and_one_read_back_per_process() -> None:
    b = WakeBackoff().after_oom(1_700_000_000.0, 5 * GI).after_oom(1_700_000_001.0, 6 * GI)
    status = {"wakeBackoff": to_status(b)}
    assert status["wakeBackoff"] == {
        "attempts": 2, "until": "2023-11-14T22:13:23.000000Z", "neededBytes": 6 * GI,
    }  # fmt: skip
    assert from_status(status) == b
    assert from_status({}) is None and from_status({"wakeBackoff": {"attempts": 0}}) is None

    class Runner:
        adopted: set[tuple[str, str]] = set()
        wake_backoffs: dict[tuple[str, str], WakeBackoff] = {}
        asleep_asked: dict[tuple[str, str], float] = {}
        asleep_restored: set[tuple[str, str]] = set()
        spec_active: dict[tuple[str, str], bool] = {}

    spec, r = parse_stage(body(state="Asleep", activation={"policy": "OnDemand"})), Runner()
    adopt_status(r, ("ns", "sd"), {**status, "awakeReason": "Manual"}, spec, now=5.0)
    assert r.wake_backoffs[("ns", "sd")] == b
    # spec.state was Active when the last operator published; it is Asleep now: patched since
    assert r.asleep_asked == {("ns", "sd"): 5.0} and r.asleep_restored == {("ns", "sd")}
    r.wake_backoffs.clear()
    adopt_status(r, ("ns", "sd"), status, spec)  # once per process: its own memory rules after
    assert not r.wake_backoffs
