"""A round's readings after its ACKs (``decisions.readings``): when the ACKs say where the group
stands, and what they say."""

from __future__ import annotations

from dataclasses import replace

from omnistage_operator.decisions.arbiter import DeviceMemory, GroupMemory, WorkerPhase
from omnistage_operator.decisions.facts import AckFacts, DeviceFigures, WorkerReport
from omnistage_operator.decisions.memory import group_memory
from omnistage_operator.decisions.readings import acked_memory, report_after_ack, reuse_reports

GIB = 1 << 30
TOTAL = 16 * GIB


def _device(used: int, free: int, *, weights: int = 0) -> DeviceFigures:
    return DeviceFigures("GPU-0", 0, TOTAL, used, used, free, free, weights)


def _report(phase: WorkerPhase, used: int, free: int) -> WorkerReport:
    return WorkerReport(
        phase, level=1 if phase is WorkerPhase.ASLEEP else None, used_bytes=used,
        free_bytes=free, total_bytes=TOTAL, source="nvml", active_footprint_bytes=9 * GIB,
        peak_active_bytes=10 * GIB, devices=(_device(used, free, weights=8 * GIB),),
    )  # fmt: skip


def _ack(op: str, before: int, after: int, free: int, at: float, **kw: object) -> AckFacts:
    state = WorkerPhase.ASLEEP if op == "sleep" else WorkerPhase.ACTIVE
    device = DeviceFigures("GPU-0", 0, TOTAL, before, after, free - (before - after), free)
    fields: dict[str, object] = {
        "level": 1 if op == "sleep" else None, "used_before_bytes": before,
        "used_after_bytes": after, "free_after_bytes": free, "total_bytes": TOTAL,
        "source": "nvml", "finished_at": at, "devices": (device,), **kw,
    }  # fmt: skip
    return AckFacts(f"h1-{op}", True, op, state, **fields)  # type: ignore[arg-type]


# ar Active with 10 GiB, sd asleep with its 0.5 GiB context: 5 GiB free on the device.
BEFORE = {
    "ar": _report(WorkerPhase.ACTIVE, 10 * GIB, 5 * GIB),
    "sd": _report(WorkerPhase.ASLEEP, GIB // 2, 5 * GIB),
}
SLEPT = _ack("sleep", 10 * GIB, GIB // 2, int(14.5 * GIB), 100.0)


def test_a_sleep_ack_is_the_workers_report_and_the_devices_latest_reading() -> None:
    reports = reuse_reports(BEFORE, {"ar"}, {"ar": SLEPT}, ["ar", "sd"])
    assert reports is not None
    ar = reports["ar"]
    assert (ar.phase, ar.level, ar.used_bytes, ar.free_bytes) == (
        WorkerPhase.ASLEEP, 1, GIB // 2, int(14.5 * GIB),
    )  # fmt: skip
    assert ar.last_ack == SLEPT and ar.devices[0].weights == 8 * GIB  # the plan's weights kept
    assert (ar.active_footprint_bytes, ar.peak_active_bytes) == (9 * GIB, 10 * GIB)
    assert reports["sd"] == BEFORE["sd"]  # asleep, not ordered: its reading stands
    # The old readings of the device say 5 GiB free; the ACK, taken after them, 14.5 GiB.
    memory = group_memory(reports)
    assert memory.free == 5 * GIB
    assert acked_memory(memory, [SLEPT]).free == int(14.5 * GIB)


def test_a_sleep_ack_carries_the_peak_the_worker_reached_since_the_reading() -> None:
    # ar served requests after the reading (10 GiB peak): its sleep's ACK says 12 GiB, as its
    # GetStatus would after the sleep, so a later reading changes nothing in its status
    served = _ack("sleep", 10 * GIB, GIB // 2, int(14.5 * GIB), 100.0, peak_active_bytes=12 * GIB)
    reports = reuse_reports(BEFORE, {"ar"}, {"ar": served}, ["ar", "sd"])
    assert reports is not None
    assert reports["ar"].peak_active_bytes == 12 * GIB


def test_a_wake_ack_sets_the_footprint_and_peak_to_what_the_wake_holds() -> None:
    woke = _ack("wake", GIB // 2, 12 * GIB, 3 * GIB, 101.0)
    asleep = report_after_ack(BEFORE["ar"], SLEPT)
    reports = reuse_reports({"ar": asleep, "sd": BEFORE["sd"]}, {"sd"}, {"sd": woke}, ["ar", "sd"])
    assert reports is not None
    sd = reports["sd"]
    assert (sd.phase, sd.level, sd.used_bytes) == (WorkerPhase.ACTIVE, None, 12 * GIB)
    assert sd.active_footprint_bytes == sd.peak_active_bytes == 12 * GIB
    assert reports["ar"] == asleep  # its own last reading: its status does not change again
    assert acked_memory(group_memory(reports), [woke]).free == 3 * GIB


def test_anything_the_acks_do_not_prove_asks_the_workers_again() -> None:
    everyone = ["ar", "sd"]
    # 9.5 GiB left the worker by its figures, but the device's free memory did not move.
    lie = DeviceFigures("GPU-0", 0, TOTAL, 10 * GIB, GIB // 2, 5 * GIB, 5 * GIB)
    cases = {
        "no ACK": ({"ar"}, {}),
        "not ok": ({"ar"}, {"ar": replace(SLEPT, ok=False, error="residual")}),
        "replayed": ({"ar"}, {"ar": replace(SLEPT, replayed=True)}),
        "component sleep": ({"ar"}, {"ar": replace(SLEPT, state=WorkerPhase.ACTIVE)}),
        "unmeasured": ({"ar"}, {"ar": replace(SLEPT, devices=(), total_bytes=0)}),
        "contradicted": ({"ar"}, {"ar": replace(SLEPT, devices=(lie,))}),
        "an Active worker not ordered": (set(), {}),
    }  # fmt: skip
    for why, (ordered, acks) in cases.items():
        assert reuse_reports(BEFORE, ordered, acks, everyone) is None, why
    unread = {"ar": BEFORE["ar"]}  # sd was not reached before: it may answer now
    assert reuse_reports(unread, {"ar"}, {"ar": SLEPT}, everyone) is None
    draining = {**BEFORE, "sd": replace(BEFORE["sd"], inflight_requests=1)}
    assert reuse_reports(draining, {"ar"}, {"ar": SLEPT}, everyone) is None


def test_the_latest_ack_measures_a_device_and_others_keep_their_figures() -> None:
    memory = GroupMemory(
        capacity=TOTAL, free=GIB,
        devices=(DeviceMemory("GPU-0", TOTAL, GIB), DeviceMemory("GPU-1", TOTAL, 2 * GIB)),
    )  # fmt: skip
    first = _ack("sleep", 10 * GIB, GIB // 2, 6 * GIB, 100.0)  # the other sleeper still held
    last = _ack("sleep", 9 * GIB, GIB // 2, 15 * GIB, 100.5)
    out = acked_memory(memory, [last, first])
    assert [d.free for d in out.devices] == [15 * GIB, 2 * GIB] and out.free == 2 * GIB
    same_time = _ack("sleep", 9 * GIB, GIB // 2, 4 * GIB, 100.5)
    assert acked_memory(memory, [last, same_time]).devices[0].free == 4 * GIB  # the lower one
