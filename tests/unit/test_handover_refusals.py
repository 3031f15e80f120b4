"""The round on refusals, lying ACKs, drains, refused wakes and unconfirmed fences (issue 14).

``ScriptedPort``: stage "a" holds memory and is told to sleep, stage "b" wants the memory. Each
test scripts how a's worker answers; the port checks the promise at every WakeUp: a is asleep
with an ok, truthful ACK, or its pod is confirmed gone.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from omnistage_operator.api import conditions as cond
from omnistage_operator.decisions.arbiter import (
    BlockReason,
    DeviceMemory,
    GroupMemory,
    StageFacts,
    StageIntent,
    WorkerPhase,
)
from omnistage_operator.decisions.facts import AckFacts, DeviceFigures
from omnistage_operator.decisions.handover import (
    FenceFailed,
    GroupObservation,
    RoundOutcome,
    RoundPolicy,
    WorkerRefused,
    WorkerUnavailable,
)
from omnistage_operator.decisions.handover.rounds import run_round
from omnistage_operator.decisions.leadership import LeadershipLost

GI = 1 << 30
TOTAL = 16 * GI
NEED = f"not enough free device memory to wake: need {20 * GI} bytes, 1 free of 2"


@dataclass
class ScriptedPort:
    sleep_script: Callable[[ScriptedPort, str, int], AckFacts]
    a: WorkerPhase = WorkerPhase.ACTIVE
    a_pod: bool = True
    a_inflight: int = 0
    a_holds: int = 8 * GI
    b_request: int | None = 4 * GI
    learned: dict[str, int] = field(default_factory=dict)
    fence_pending: bool = False
    fence_works: bool = True
    wake_refusal: WorkerRefused | None = None
    calls: list[tuple[str, str, str]] = field(default_factory=list)
    timeouts: list[float | None] = field(default_factory=list)
    probe_phase: WorkerPhase | None = None
    tenant: int = 0  # bytes another process (outside the group) holds

    def _free(self) -> int:
        # 1 GiB: reserve + contexts
        return TOTAL - GI - (self.a_holds if self.a_pod else 0) - self.tenant

    async def observe(self) -> GroupObservation:
        intents = {
            "a": StageIntent("a", False, drain_timeout_s=0.3),
            "b": StageIntent("b", True, vram_request=self.b_request),
        }
        a = (
            StageFacts(self.a, level=1 if self.a is WorkerPhase.ASLEEP else None,
                       inflight_requests=self.a_inflight, fence_pending=self.fence_pending,
                       device_uuids=("GPU-0",))
            if self.a_pod
            else StageFacts(WorkerPhase.ABSENT)
        )  # fmt: skip
        b = StageFacts(WorkerPhase.ASLEEP, level=1, learned_need=self.learned.get("b"))
        free = self._free()
        mem = GroupMemory(TOTAL, free, (DeviceMemory("GPU-0", TOTAL, free),))
        return GroupObservation(intents, {"a": a, "b": b}, mem)

    async def probe(self, stage: str) -> StageFacts:
        facts = (await self.observe()).facts[stage]
        if self.probe_phase is not None:
            return StageFacts(self.probe_phase, inflight_requests=self.a_inflight)
        return facts

    async def start(self, stage: str) -> None:
        self.calls.append(("start", stage, ""))

    async def sleep(
        self,
        stage: str,
        level: int,
        task_id: str,
        *,
        drain_timeout_s: float | None = None,
        timeout_s: float | None = None,
        components: tuple[str, ...] = (),
    ) -> AckFacts:
        self.calls.append(("sleep", stage, task_id))
        self.timeouts.append(timeout_s)
        return self.sleep_script(self, task_id, level)

    async def wake(self, stage: str, task_id: str) -> AckFacts:
        self.calls.append(("wake", stage, task_id))
        assert not self.a_pod or (self.a is WorkerPhase.ASLEEP and self.a_holds == 0), (
            "wake while a may hold memory"
        )
        if self.wake_refusal is not None:
            raise self.wake_refusal
        return AckFacts(task_id, True, "wake", WorkerPhase.ACTIVE)

    async def fence(self, stage: str, reason: str) -> None:
        self.calls.append(("fence", stage, reason))
        if not self.fence_works:
            self.fence_pending = True
            raise FenceFailed(f"pod of {stage} not confirmed gone")
        self.a_pod, self.fence_pending = False, False

    async def checkpoint(self, outcome: RoundOutcome) -> None:
        self.calls.append(("checkpoint", "", ""))


def _ok(port: ScriptedPort, task_id: str, level: int) -> AckFacts:
    before = port._free()
    port.a, port.a_holds = WorkerPhase.ASLEEP, 0
    dev = DeviceFigures("GPU-0", 0, TOTAL, 8 * GI, 0, before, port._free())
    return AckFacts(task_id, True, "sleep", WorkerPhase.ASLEEP, level=level,
                    freed_bytes=8 * GI, devices=(dev,), free_before_bytes=before,
                    free_after_bytes=port._free(), total_bytes=TOTAL)  # fmt: skip


def _refuse(code: str, message: str) -> Callable[[ScriptedPort, str, int], AckFacts]:
    def script(port: ScriptedPort, task_id: str, level: int) -> AckFacts:
        raise WorkerRefused(code, message)

    return script


POLICY = RoundPolicy(ack_retries=2, backoff_s=0.01, retry_window_s=30.0)


def _ops(port: ScriptedPort) -> list[tuple[str, str]]:
    return [(op, stage) for op, stage, _ in port.calls if op != "checkpoint"]


async def test_refused_sleep_is_reported_not_retried_for_the_window_then_fenced() -> None:
    """A refusal used to read as silence: retried for the 60 s window, each round."""
    port = ScriptedPort(_refuse("FAILED_PRECONDITION", "level: 2 is not supported"))
    t0 = time.monotonic()
    out = await run_round(port, POLICY, lambda: "h1")
    assert time.monotonic() - t0 < 5.0  # not the 30 s window
    (s,) = out.sleeps
    assert s.attempts == 2 and s.fenced and not s.ok
    assert s.refusal is not None and s.refusal.code == "FAILED_PRECONDITION"
    assert s.reason is cond.Reason.SLEEP_REFUSED and "level: 2" in s.message
    assert _ops(port) == [("sleep", "a"), ("sleep", "a"), ("fence", "a"), ("wake", "b")]


async def test_failed_worker_refusal_is_fenced_at_once() -> None:
    port = ScriptedPort(_refuse("FAILED_PRECONDITION", "worker failed: residual too high"))
    out = await run_round(port, POLICY, lambda: "h1")
    (s,) = out.sleeps
    assert s.attempts == 1 and s.fenced and s.reason is cond.Reason.WORKER_FAILED
    assert _ops(port) == [("sleep", "a"), ("fence", "a"), ("wake", "b")]


async def test_stale_epoch_refusal_stops_the_round_without_fencing() -> None:
    port = ScriptedPort(_refuse("FAILED_PRECONDITION", "epoch 3 is below the worker's 4"))
    with pytest.raises(LeadershipLost):
        await run_round(port, POLICY, lambda: "h1")
    assert _ops(port) == [("sleep", "a")]


async def test_not_ok_ack_is_retried_under_a_new_task_id() -> None:
    def script(port: ScriptedPort, task_id: str, level: int) -> AckFacts:
        if task_id == "h1-a-sleep1":  # the worker caches this not-ok Ack under the id
            return AckFacts(task_id, False, "sleep", WorkerPhase.ACTIVE, error="drain timeout")
        return _ok(port, task_id, level)

    port = ScriptedPort(script)
    out = await run_round(port, POLICY, lambda: "h1")
    (s,) = out.sleeps
    assert s.ok and s.task_ids == ("h1-a-sleep1", "h1-a-sleep1-r1") and not s.fenced
    assert _ops(port) == [("sleep", "a"), ("sleep", "a"), ("wake", "b")]


async def test_unanswered_sleep_is_retried_under_the_same_task_id() -> None:
    answers = iter(["lost", "ok"])

    def script(port: ScriptedPort, task_id: str, level: int) -> AckFacts:
        if next(answers) == "lost":
            raise WorkerUnavailable("deadline exceeded")
        return _ok(port, task_id, level)

    port = ScriptedPort(script)
    out = await run_round(port, POLICY, lambda: "h1")
    assert out.sleeps[0].ok and out.sleeps[0].task_ids == ("h1-a-sleep1",)


async def test_ok_ack_contradicted_by_the_device_is_fenced_before_any_wake() -> None:
    def liar(port: ScriptedPort, task_id: str, level: int) -> AckFacts:
        free = port._free()  # says asleep and 8 GiB freed; the device gained nothing
        port.a = WorkerPhase.ASLEEP
        dev = DeviceFigures("GPU-0", 0, TOTAL, 8 * GI, 0, free, free)
        return AckFacts(task_id, True, "sleep", WorkerPhase.ASLEEP, level=level,
                        freed_bytes=8 * GI, devices=(dev,), free_before_bytes=free,
                        free_after_bytes=free, total_bytes=TOTAL)  # fmt: skip

    port = ScriptedPort(liar)
    out = await run_round(port, POLICY, lambda: "h1")
    (s,) = out.sleeps
    assert not s.ok and s.fenced and s.reason is cond.Reason.ACK_CONTRADICTED
    assert "gained 0" in s.contradiction and s.attempts == 1
    assert _ops(port) == [("sleep", "a"), ("fence", "a"), ("wake", "b")]


async def test_a_draining_sleep_is_waited_for_not_fenced() -> None:
    """The worker drains in-flight requests for up to its drain timeout; the round waits (it
    used to fence after its retries)."""
    started = time.monotonic()

    def draining(port: ScriptedPort, task_id: str, level: int) -> AckFacts:
        if time.monotonic() - started < 0.25:
            port.a = WorkerPhase.SLEEPING
            raise WorkerUnavailable("deadline exceeded")
        port.a_inflight = 0
        return _ok(port, task_id, level)

    port = ScriptedPort(draining, a_inflight=2)
    policy = RoundPolicy(ack_retries=1, backoff_s=0.02, transition_allowance_s=0.2)
    out = await run_round(port, policy, lambda: "h1")
    (s,) = out.sleeps
    assert s.ok and s.drained and not s.fenced
    assert port.timeouts[0] == pytest.approx(0.5, abs=0.01)  # drain 0.3 s + allowance 0.2 s
    assert [op for op, _ in _ops(port)][-1] == "wake"


async def test_a_drain_past_its_timeout_ends_in_the_fence() -> None:
    def hung(port: ScriptedPort, task_id: str, level: int) -> AckFacts:
        port.a = WorkerPhase.SLEEPING
        raise WorkerUnavailable("deadline exceeded")

    port = ScriptedPort(hung, a_inflight=1)
    policy = RoundPolicy(ack_retries=1, backoff_s=0.02, transition_allowance_s=0.1)
    t0 = time.monotonic()
    out = await run_round(port, policy, lambda: "h1")
    assert out.sleeps[0].fenced and time.monotonic() - t0 < 3.0
    # Without requests in flight the deadline is the transition allowance alone.
    port2 = ScriptedPort(_ok)
    await run_round(port2, policy, lambda: "h2")
    assert port2.timeouts == [pytest.approx(0.1)]


async def test_wake_refused_for_memory_learns_the_need_and_stops_asking() -> None:
    """It used to resend WakeUp every round, forever."""
    port = ScriptedPort(_ok, a=WorkerPhase.ASLEEP, a_holds=0, b_request=None)
    port.wake_refusal = WorkerRefused("RESOURCE_EXHAUSTED", NEED)
    out = await run_round(port, POLICY, lambda: "h1")
    assert _ops(port) == [("wake", "b")]  # one WakeUp, not retried in the round
    assert out.learned_needs == {"b": 20 * GI}
    assert out.wake_refusals["b"].code == "RESOURCE_EXHAUSTED"
    assert out.decision is not None
    assert out.decision.waiting["b"][0].reason is BlockReason.TOO_LARGE  # 20 GiB > 16 GiB
    port.learned.update(out.learned_needs)  # what the kube side persists in status
    port.calls.clear()
    out = await run_round(port, POLICY, lambda: "h2")
    assert _ops(port) == []
    assert out.decision is not None
    assert out.decision.waiting["b"][0].reason.value == "LargerThanDevice"


async def test_wake_not_ok_for_memory_learns_the_need_too() -> None:
    port = ScriptedPort(_ok, a=WorkerPhase.ASLEEP, a_holds=0, b_request=None)

    async def wake(stage: str, task_id: str) -> AckFacts:
        port.calls.append(("wake", stage, task_id))
        return AckFacts(task_id, False, "wake", WorkerPhase.ASLEEP, error=NEED)

    port.wake = wake  # type: ignore[method-assign]
    out = await run_round(port, POLICY, lambda: "h1")
    assert out.learned_needs == {"b": 20 * GI}


async def test_wake_out_of_memory_mid_copy_is_charged_and_not_sent_again() -> None:
    """The gate let b's wake through; another tenant took 10 GiB before the copy, which ran
    out: the worker is back asleep and says it needed 3 GiB more than the 5 GiB free. b is now
    charged at least that (it was never measured: no footprint before), so the next round does
    not wake it into the same room; once the tenant has gone it is woken."""
    port = ScriptedPort(_ok, a=WorkerPhase.ASLEEP, a_holds=0, b_request=None)
    context, weights = GI // 2, 8 * GI
    wakes: list[AckFacts] = []

    async def wake(stage: str, task_id: str) -> AckFacts:
        port.calls.append(("wake", stage, task_id))
        if not wakes:  # between the gate and the copy, the tenant arrives
            port.tenant = 10 * GI
        free = port._free()
        if weights <= free:
            wakes.append(AckFacts(task_id, True, "wake", WorkerPhase.ACTIVE))
            return wakes[-1]
        dev = DeviceFigures("GPU-0", 0, TOTAL, context, context, free, free)
        wakes.append(
            AckFacts(task_id, False, "wake", WorkerPhase.ASLEEP, level=1,
                     error="wake from level 1 failed: CUDA out of memory. (needed ...)",
                     used_after_bytes=context, free_after_bytes=free, devices=(dev,),
                     needed_bytes=weights - free)
        )  # fmt: skip
        return wakes[-1]

    port.wake = wake  # type: ignore[method-assign]
    out = await run_round(port, POLICY, lambda: "h1")
    assert _ops(port) == [("wake", "b")]
    assert set(out.wake_oom) == {"b"} and out.wake_oom["b"].needed_bytes == 3 * GI
    assert out.learned_needs == {"b": context + 5 * GI + 3 * GI}
    port.learned.update(out.learned_needs)  # what the kube side persists in status
    port.calls.clear()
    out = await run_round(port, POLICY, lambda: "h2")
    assert _ops(port) == []  # not re-sent into the room the tenant holds
    assert out.decision is not None and out.decision.waiting["b"]
    port.tenant = 0  # the tenant leaves
    out = await run_round(port, POLICY, lambda: "h3")
    assert _ops(port) == [("wake", "b")] and out.wakes["b"].ok


async def test_unconfirmed_fence_stays_pending_and_keeps_the_gate_closed() -> None:
    port = ScriptedPort(_refuse("FAILED_PRECONDITION", "worker failed: boom"), fence_works=False)
    out = await run_round(port, POLICY, lambda: "h1")
    assert out.fence_pending == {"a"} and out.sleeps[0].fence_pending
    assert ("wake", "b") not in _ops(port)
    # Next round (or a restarted operator): the persisted pending fence is ordered again and
    # nothing wakes until it is confirmed.
    port.calls.clear()
    port.a = WorkerPhase.ASLEEP  # whatever the worker says now
    port.a_holds = 0
    out = await run_round(port, POLICY, lambda: "h2")
    assert _ops(port) == [("fence", "a")]
    assert out.fences[0].order.reason is BlockReason.FENCE_PENDING and not out.fences[0].fenced
    port.fence_works = True
    port.calls.clear()
    out = await run_round(port, POLICY, lambda: "h3")
    assert _ops(port) == [("fence", "a"), ("wake", "b")]
    assert out.fence_confirmed == {"a"}


@dataclass
class ClaimPort:
    """A group whose claim holds one GPU: "one" (gpus 1) runs, "wide" (gpus 2) has no pod."""

    started: list[str] = field(default_factory=list)

    async def observe(self) -> GroupObservation:
        intents = {
            "one": StageIntent("one", False, vram_request=GI),
            "wide": StageIntent("wide", True, vram_request=GI, gpus=2),
        }
        facts = {
            "one": StageFacts(WorkerPhase.ASLEEP, level=1, device_uuids=("GPU-0",)),
            "wide": StageFacts(WorkerPhase.ABSENT),
        }
        devs = (DeviceMemory("GPU-0", TOTAL, TOTAL - GI),)
        mem = GroupMemory(TOTAL, TOTAL - GI, devs, claim_uuids=("GPU-0",))
        return GroupObservation(intents, facts, mem)

    async def start(self, stage: str) -> None:
        self.started.append(stage)

    async def probe(self, stage: str) -> StageFacts:
        return (await self.observe()).facts[stage]


async def test_no_pod_for_a_stage_wider_than_the_claim() -> None:
    port = ClaimPort()
    out = await run_round(port, POLICY, lambda: "h1")  # type: ignore[arg-type]
    assert port.started == [] and out.started == []  # its worker could not see its devices
    assert out.decision is not None
    (blocker,) = out.decision.waiting["wide"]
    assert blocker.reason is BlockReason.CLAIM_TOO_SMALL


def test_a_refused_deepening_is_not_ordered_again() -> None:
    """Issue 19: a 1->2 deepening the worker refuses (its backend cannot drop the host copy
    without waking) used to be ordered again every round."""
    from omnistage_operator.k8s.port_facts import deepen_level

    asleep_1 = StageFacts(WorkerPhase.ASLEEP, level=1)
    assert deepen_level(2, asleep_1, None) == 2  # not refused yet: ordered
    assert deepen_level(2, asleep_1, 2) == 1  # refused: asked for the level it is at
    assert deepen_level(2, StageFacts(WorkerPhase.ACTIVE), 2) == 2  # woke: the spec again
    assert deepen_level(1, asleep_1, 2) == 1  # the spec changed


def test_a_stage_loading_asleep_does_not_hold_up_the_groups_wakes() -> None:
    """Issue 19: a worker loading in a pod created asleep (weights into host memory, only its
    context on the device) blocked every wake of its group for its whole load."""
    from omnistage_operator.decisions.arbiter.plan import plan
    from omnistage_operator.k8s.port_facts import loading_asleep

    intents = {"a": StageIntent("a", False), "b": StageIntent("b", True, vram_request=4 * GI)}
    free = TOTAL - 2 * GI
    memory = GroupMemory(TOTAL, free, (DeviceMemory("GPU-0", TOTAL, free),))
    b = StageFacts(WorkerPhase.ASLEEP, level=1, used_bytes=GI // 2, context_bytes=GI // 2)
    loading = StageFacts(WorkerPhase.LOADING, used_bytes=GI // 2)
    assert plan(intents, {"a": loading, "b": b}, memory).wake == ()  # the hole
    asleep_pod = {"metadata": {"annotations": {"omnistage.io/initial-state": "Asleep"}}}
    seen = loading_asleep(loading, asleep_pod)
    assert seen.phase is WorkerPhase.STARTING
    assert plan(intents, {"a": seen, "b": b}, memory).wake == ("b",)
    active_pod = {"metadata": {"annotations": {"omnistage.io/initial-state": "Active"}}}
    assert loading_asleep(loading, active_pod) is loading  # vLLM takes memory while it loads
