"""The back-off after wakes that ran out of device memory, and what the condition says."""

from __future__ import annotations

from omnistage_operator.arbiter import WorkerPhase
from omnistage_operator.facts import AckFacts, DeviceFigures
from omnistage_operator.wake_backoff import MAX_S, WakeBackoff, oom_message

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
