"""Worker facts from protos, and what their figures prove (pure)."""

from __future__ import annotations

from google.protobuf.duration_pb2 import Duration

from omnistage.worker.v1 import sleep_service_pb2, types_pb2
from omnistage_operator.decisions.arbiter import WorkerPhase
from omnistage_operator.decisions.facts import (
    AckFacts,
    DeviceFigures,
    WorkerReport,
    ack_contradiction,
    ack_from_proto,
    memory_need,
    report_from_proto,
)
from omnistage_operator.decisions.memory import group_memory

GI = 1 << 30
MI = 1 << 20


def _sleep_ack(freed: int, free_before: int, free_after: int, total: int = 80 * GI) -> AckFacts:
    dev = DeviceFigures("GPU-0", 0, total, freed, 0, free_before, free_after)
    return AckFacts(
        "t1", True, "sleep", WorkerPhase.ASLEEP, level=1, freed_bytes=freed,
        free_after_bytes=free_after, free_before_bytes=free_before, total_bytes=total,
        devices=(dev,),
    )  # fmt: skip


def test_ok_sleep_ack_contradicted_by_the_device_is_not_trusted() -> None:
    # Claims 16 GiB freed; the device's free memory did not move.
    lie = _sleep_ack(16 * GI, 10 * GI, 10 * GI)
    why = ack_contradiction(lie)
    assert why is not None and str(16 * GI) in why and "gained 0" in why
    # Within the tolerance max(2% of 80 GiB = 1.6 GiB, 256 MiB): trusted.
    assert ack_contradiction(_sleep_ack(16 * GI, 10 * GI, 26 * GI - GI)) is None
    # On a small device the 256 MiB floor applies.
    assert ack_contradiction(_sleep_ack(GI, 0, GI - 200 * MI, total=2 * GI)) is None
    assert ack_contradiction(_sleep_ack(GI, 0, GI - 300 * MI, total=2 * GI)) is not None
    # Not-ok ACKs, wakes and ACKs without device figures are not judged here.
    assert (
        ack_contradiction(AckFacts("t", True, "sleep", WorkerPhase.ASLEEP, freed_bytes=GI)) is None
    )


def test_report_marks_an_asleep_worker_whose_sleep_ack_lied() -> None:
    rep = WorkerReport(WorkerPhase.ASLEEP, level=1, last_ack=_sleep_ack(16 * GI, GI, GI))
    facts = rep.stage_facts(fence_pending=True, learned_need=3 * GI)
    assert facts.ack_contradicted and facts.fence_pending and facts.learned_need == 3 * GI
    honest = WorkerReport(WorkerPhase.ASLEEP, level=1, last_ack=_sleep_ack(16 * GI, GI, 17 * GI))
    assert honest.stage_facts().ack_contradicted is None


def test_memory_need_from_a_refused_wake() -> None:
    msg = "not enough free device memory to wake: need 17179869184 bytes, 1024 free of 2048"
    assert memory_need(msg) == 16 * GI
    assert memory_need("worker failed: boom") is None


def test_protos_carry_the_new_figures() -> None:
    ack = types_pb2.Ack(
        task_id="t", ok=True, operation=types_pb2.OPERATION_SLEEP, freed_bytes=GI,
        devices=[types_pb2.DeviceMemory(uuid="GPU-0", total_bytes=80 * GI,
                                        free_before_bytes=GI, free_after_bytes=2 * GI)],
        drain_duration=Duration(seconds=6), epoch=4, peak_active_bytes=20 * GI,
    )  # fmt: skip
    a = ack_from_proto(ack)
    assert (a.drain_s, a.epoch, a.peak_active_bytes) == (6.0, 4, 20 * GI)
    assert a.free_before_bytes == GI and a.device_free_gain == GI
    assert a.devices[0].uuid == "GPU-0"
    st = sleep_service_pb2.GetStatusResponse(
        state=types_pb2.WORKER_STATE_ACTIVE, inflight_requests=3, peak_active_bytes=20 * GI,
        context_bytes=612 * MI, epoch=2, drain_timeout=Duration(seconds=600),
        devices=[types_pb2.DeviceMemory(uuid="GPU-0", total_bytes=80 * GI,
                                        free_after_bytes=50 * GI)],
    )  # fmt: skip
    r = report_from_proto(st)
    assert (r.inflight_requests, r.context_bytes, r.drain_timeout_s) == (3, 612 * MI, 600.0)
    f = r.stage_facts()
    assert f.peak_active == 20 * GI and f.inflight_requests == 3
    assert f.device_uuids == ("GPU-0",) and f.context_bytes == 612 * MI


def _gpu(uuid: str, total: int, free: int) -> DeviceFigures:
    return DeviceFigures(uuid=uuid, total=total, free_after=free)


def test_group_memory_counts_gpus_per_device_and_never_host_ram() -> None:
    a = WorkerReport(WorkerPhase.ASLEEP, total_bytes=80 * GI, free_bytes=79 * GI,
                     devices=(_gpu("GPU-0", 80 * GI, 79 * GI),))  # fmt: skip
    b = WorkerReport(WorkerPhase.ACTIVE, total_bytes=80 * GI, free_bytes=60 * GI,
                     devices=(_gpu("GPU-0", 80 * GI, 60 * GI),))  # fmt: skip
    cpu = WorkerReport(WorkerPhase.ACTIVE, total_bytes=512 * GI, free_bytes=400 * GI,
                       devices=(DeviceFigures(total=512 * GI, free_after=400 * GI),))  # fmt: skip
    mem = group_memory({"a": a, "b": b, "cpu": cpu}, {"a": 1, "b": 1, "cpu": 0}, ["GPU-0"])
    assert (mem.capacity, mem.free) == (80 * GI, 60 * GI)
    assert [(d.uuid, d.free) for d in mem.devices] == [("GPU-0", 60 * GI)]
    assert mem.claim_uuids == ("GPU-0",) and mem.gpu
    # Only the CPU stage answered: its host RAM is not the GPU's memory.
    assert group_memory({"cpu": cpu}, {"a": 1, "cpu": 0}).free is None
    # A group on an accounting device (no UUIDs, as in CI) keeps its scalar figures.
    acc = WorkerReport(WorkerPhase.ASLEEP, total_bytes=GI, free_bytes=GI // 2)
    mem = group_memory({"a": acc}, {"a": 1})
    assert (mem.capacity, mem.free, mem.devices) == (GI, GI // 2, ())
    assert group_memory({}).free is None
