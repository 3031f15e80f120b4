"""Pure logic of the worker: byte flags, devices, planning, health, acks, NVML mapping."""

from __future__ import annotations

import sys
from datetime import UTC, datetime

import grpc
import pytest

from omnistage.worker.v1 import types_pb2
from omnistage_worker.config import ConfigError, Identity, parse_byte_flag, parse_device
from omnistage_worker.control.acks import Outcome, build_ack
from omnistage_worker.control.transitions import (
    Current,
    Plan,
    Refused,
    check_epoch,
    generate_refusal,
    level_from_proto,
    plan_sleep,
    plan_wake,
    residual_error,
)
from omnistage_worker.host_allocator import fix_mmap_threshold
from omnistage_worker.memory import DeviceReading, Reading, nvml_target, pick_grown_pid
from omnistage_worker.serving.health import (
    INFERENCE_SERVICE,
    NOT_SERVING,
    OVERALL,
    SERVING,
    statuses,
)

WS = types_pb2


@pytest.mark.parametrize("text", ["", "Gi", "-1", "1.2.3", "12Xi", "ten"])
def test_byte_flag_refusals_name_the_flag(text: str) -> None:
    """The grammar itself is tested once, in tests/unit/test_quantities.py."""
    with pytest.raises(ConfigError) as info:
        parse_byte_flag(text, "--residual-slack")
    assert info.value.flag == "--residual-slack"


def test_parse_device() -> None:
    assert str(parse_device("cpu")) == "cpu"
    assert str(parse_device("cuda")) == "cuda:0"
    assert parse_device("cuda:3").index == 3
    for bad in ("gpu", "cuda:x", "cpu:1", "cuda:-1"):
        with pytest.raises(ConfigError):
            parse_device(bad)


ACTIVE = Current(WS.WORKER_STATE_ACTIVE, 0)
ASLEEP1 = Current(WS.WORKER_STATE_ASLEEP, 1)
ASLEEP2 = Current(WS.WORKER_STATE_ASLEEP, 2)


def test_planning() -> None:
    assert plan_sleep(ACTIVE, 1) is Plan.SLEEP
    assert plan_sleep(ASLEEP1, 1) is Plan.NOOP
    assert plan_sleep(ASLEEP1, 2) is Plan.DEEPEN
    assert plan_sleep(ASLEEP2, 1) is Plan.NOOP
    assert plan_wake(ACTIVE) is Plan.NOOP
    assert plan_wake(ASLEEP2) is Plan.WAKE
    with pytest.raises(Refused) as info:
        plan_wake(Current(WS.WORKER_STATE_LOADING, 0))
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(Refused) as info:
        plan_sleep(Current(WS.WORKER_STATE_FAILED, 0, "boom"), 1)
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert info.value.message == "worker failed: boom"


def test_failed_residual_is_measured_again_never_woken() -> None:
    failed = Current(WS.WORKER_STATE_FAILED, 1, "device memory still used", residual=True)
    assert plan_sleep(failed, 1) is Plan.RECHECK
    assert plan_sleep(failed, 2) is Plan.RECHECK
    with pytest.raises(Refused) as info:
        plan_wake(failed)
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert info.value.message == "worker failed: device memory still used"


def test_epochs() -> None:
    check_epoch(5, 5)
    check_epoch(6, 5)
    check_epoch(0, 0)  # no election, and none ever obeyed
    with pytest.raises(Refused, match=r"epoch 0 .*obeyed epoch 5"):
        check_epoch(0, 5)  # once an elected leader was obeyed, no election is refused
    with pytest.raises(Refused) as info:
        check_epoch(3, 5)
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert info.value.message == "order from epoch 3 refused: this worker has obeyed epoch 5"
    with pytest.raises(Refused) as info:
        check_epoch(-1, 0)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_generate_refusals() -> None:
    assert generate_refusal(ACTIVE) is None
    messages = {
        WS.WORKER_STATE_ASLEEP: "worker is asleep (level 2)",
        WS.WORKER_STATE_SLEEPING: "worker is sleeping",
        WS.WORKER_STATE_WAKING: "worker is waking",
    }
    for state, message in messages.items():
        refusal = generate_refusal(Current(state, 2))
        assert refusal is not None and refusal.message == message
        assert refusal.code == grpc.StatusCode.FAILED_PRECONDITION


def test_levels_and_residual() -> None:
    assert level_from_proto(WS.SLEEP_LEVEL_OFFLOAD) == 1
    assert level_from_proto(WS.SLEEP_LEVEL_DISCARD) == 2
    for bad in (0, 3, -1):
        with pytest.raises(Refused) as info:
            level_from_proto(bad)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.message.startswith("level:")
    assert residual_error(100, 100) == ""
    assert "101 bytes" in residual_error(101, 100)


def test_health_statuses() -> None:
    assert statuses(ACTIVE)[INFERENCE_SERVICE] == SERVING
    assert statuses(ASLEEP1)[INFERENCE_SERVICE] == NOT_SERVING
    assert statuses(ASLEEP1)[OVERALL] == SERVING
    failed = statuses(Current(WS.WORKER_STATE_FAILED, 0, "x"))
    assert set(failed.values()) == {NOT_SERVING}


def test_ack_sums_devices() -> None:
    def reading(used: tuple[int, int]) -> Reading:
        return Reading(
            (
                DeviceReading("cuda:0", 0, "GPU-a", used[0], 1000 - used[0], 1000),
                DeviceReading("cuda:1", 1, "GPU-b", used[1], 1000 - used[1], 1000),
            ),
            WS.MEMORY_SOURCE_NVML,
        )

    now = datetime.now(UTC)
    ack = build_ack(
        Outcome(
            "t",
            WS.OPERATION_SLEEP,
            WS.WORKER_STATE_ASLEEP,
            1,
            reading((600, 500)),
            reading((100, 50)),
            now,
            now,
            0.25,
            bytes_moved=950,
            residual_bound=200,
        ),
        Identity(stage="s", pod="p", rank=1),
    )
    assert ack.ok and ack.level == WS.SLEEP_LEVEL_OFFLOAD
    assert [d.freed_bytes for d in ack.devices] == [500, 450]
    assert ack.freed_bytes == 950 and ack.used_after_bytes == 150
    assert ack.free_after_bytes == 1850
    assert [d.free_before_bytes for d in ack.devices] == [400, 500]
    assert not ack.HasField("drain_started_at")
    assert ack.duration.ToMilliseconds() == 250
    assert ack.worker.rank == 1 and ack.source == WS.MEMORY_SOURCE_NVML


def test_nvml_target() -> None:
    assert nvml_target(1, None) == ("index", "1")
    assert nvml_target(0, "3,1") == ("index", "3")
    assert nvml_target(1, "GPU-aaa, GPU-bbb") == ("uuid", "GPU-bbb")
    with pytest.raises(ValueError, match="not visible"):
        nvml_target(2, "0,1")


def test_pick_grown_pid() -> None:
    n = 256
    assert pick_grown_pid({1: 100, 2: 50}, {1: 100, 2: 50 + n}, n) == 2
    assert pick_grown_pid({1: 100}, {1: 100, 7: n}, n) == 7  # a pid new to the list
    assert pick_grown_pid({1: 0, 2: 0}, {1: n, 2: n}, n) is None  # ambiguous
    assert pick_grown_pid({1: 0}, {1: n // 2}, n) is None  # not grown enough


def test_fix_mmap_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "4096")
    assert not fix_mmap_threshold()  # the environment's setting wins
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    assert fix_mmap_threshold() == sys.platform.startswith("linux")
