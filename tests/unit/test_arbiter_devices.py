"""Examples of the group arbiter on a claim of several devices: every device a stage uses must
fit and is checked by the gate, devices that do not match block every wake, CPU stages stay
apart."""

from __future__ import annotations

from omnistage_operator.decisions.arbiter import (
    BlockReason,
    DeviceMemory,
    GroupMemory,
    StageFacts,
    StageIntent,
    WorkerPhase,
)
from omnistage_operator.decisions.arbiter.gate import device_mismatches
from omnistage_operator.decisions.arbiter.plan import plan

GI = 1 << 30


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
