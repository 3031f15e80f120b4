"""A round plans its first step from the group's kept readings (``readings.KeptReadings``).

A hand-over round used to ask every worker for its GetStatus before its first Sleep, although
the round before had just read them (or proved their state with its ACKs). While those readings
are still the group's (same epoch, same pods at the same resourceVersion, every worker Active or
Asleep, not old), the round sends its sleeps from them: one worker round trip less before the
first Sleep (the asleep workers are read beside the sleeps). Only whole sleeps of every Active
stage go out that way; the gate after them reads the group from their ACKs and those answers, or
reads every worker when they do not say where it stands.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

import pytest

from omnistage_operator.api.spec_parse import parse_stage
from omnistage_operator.decisions.arbiter import GroupMemory, StageFacts, StageIntent, WorkerPhase
from omnistage_operator.decisions.facts import AckFacts, DeviceFigures, WorkerReport
from omnistage_operator.decisions.handover import GroupObservation, RoundOutcome
from omnistage_operator.decisions.handover.rounds import run_round
from omnistage_operator.decisions.readings import (
    KEPT_MAX_AGE_S,
    acks_measure,
    keep_readings,
    kept_reports,
)
from omnistage_operator.k8s.port import KubeGroupPort
from omnistage_operator.k8s.settings import Settings
from omnistage_operator.runtime.runner import GroupRunner
from tests.unit.test_publish_order import _body
from tests.unit.test_readings import BEFORE, GIB, SLEPT, TOTAL
from tests.unit.test_sleep_tasks import POLICY

PODS = {"ar": ("p-ar", "10"), "sd": ("p-sd", "11")}


def test_readings_are_kept_only_when_every_worker_is_settled() -> None:
    kept = keep_readings(BEFORE, PODS, 3, 50.0)
    assert kept is not None and kept.reports == BEFORE
    assert keep_readings({"ar": BEFORE["ar"]}, PODS, 3, 50.0) is None  # sd not read
    for changed in (
        replace(BEFORE["ar"], phase=WorkerPhase.SLEEPING),
        replace(BEFORE["ar"], phase=WorkerPhase.FAILED),
        replace(BEFORE["ar"], inflight_requests=1),
    ):
        assert keep_readings({**BEFORE, "ar": changed}, PODS, 3, 50.0) is None, changed


def test_kept_readings_are_the_groups_while_nothing_moved() -> None:
    kept = keep_readings(BEFORE, PODS, 3, 50.0)
    assert kept_reports(kept, PODS, 3, 51.0) == BEFORE
    assert kept_reports(kept, PODS, 4, 51.0) is None  # another leadership epoch
    assert kept_reports(kept, {**PODS, "sd": ("p-sd", "12")}, 3, 51.0) is None  # pod changed
    assert kept_reports(kept, {**PODS, "sd": ("p-sd2", "13")}, 3, 51.0) is None  # replaced
    assert kept_reports(kept, {"ar": PODS["ar"]}, 3, 51.0) is None  # a pod went away
    assert kept_reports(kept, PODS, 3, 50.0 + KEPT_MAX_AGE_S + 0.1) is None  # too old
    assert kept_reports(None, PODS, 3, 51.0) is None


def test_the_acks_must_measure_every_device_the_readings_name() -> None:
    assert acks_measure(BEFORE.values(), [SLEPT])
    other = DeviceFigures("GPU-1", 1, TOTAL, 0, 0, TOTAL, TOTAL)
    two = {**BEFORE, "sd": replace(BEFORE["sd"], devices=(other,))}
    assert not acks_measure(two.values(), [SLEPT])  # GPU-1: no ACK read it
    assert not acks_measure(BEFORE.values(), [])


# -- the port: no GetStatus before the plan while the kept readings hold -------------------


def _port(
    monkeypatch: pytest.MonkeyPatch, kept: Any = None, rv: str = "11"
) -> tuple[KubeGroupPort, list[str]]:
    runner = GroupRunner(object(), Settings())  # type: ignore[arg-type]
    port = KubeGroupPort(runner, "ns", "g", kept)
    asked: list[str] = []
    for name, state in (("ar", "Active"), ("sd", "Asleep")):
        body = {**_body(name, state), "status": {}}
        port.specs[name], port.bodies[name] = parse_stage(body), body
        uid, version = PODS[name] if name == "ar" else (PODS[name][0], rv)
        labels = {"omnistage.io/group": "g", "omnistage.io/stage": name}
        meta = {"name": f"{name}-worker", "uid": uid, "resourceVersion": version, "labels": labels}
        port.pods[name] = {"metadata": meta, "status": {"podIP": "127.0.0.1"}}
    port._listed, port._claims_read = True, True

    async def status_of(name: str, pod: Any) -> WorkerReport:
        asked.append(name)
        return BEFORE[name]

    monkeypatch.setattr(port, "_status_of", status_of)
    return port, asked


async def test_a_round_after_a_round_reads_no_worker_before_its_plan(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    first, asked = _port(monkeypatch)
    assert not (await first.observe()).kept and sorted(asked) == ["ar", "sd"]
    kept = first.kept_readings()
    assert kept is not None

    port, asked = _port(monkeypatch, kept)
    obs = await port.observe()
    assert obs.kept and asked == []  # planned from the kept readings, nobody awaited
    assert obs.facts["ar"].phase is WorkerPhase.ACTIVE
    # ar's sleep ACK measured the device; sd, asleep, was read beside the sleep: the gate
    # asks nobody (ar is never read in this round).
    port._ordered, port._acks = {"ar"}, {"ar": SLEPT}
    after = await port.observe()
    assert not after.kept and asked == ["sd"]
    assert after.facts["ar"].phase is WorkerPhase.ASLEEP
    assert after.memory.free == int(14.5 * GIB)  # the ACK's reading of the device


async def test_a_pod_that_changed_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    kept = keep_readings(BEFORE, PODS, 0, time.monotonic())
    port, asked = _port(monkeypatch, kept, rv="12")  # sd's pod changed since
    assert not (await port.observe()).kept and sorted(asked) == ["ar", "sd"]


async def test_a_listing_that_deleted_a_pod_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    kept = keep_readings(BEFORE, PODS, 0, time.monotonic())
    port, asked = _port(monkeypatch, kept)
    port.listing_deleted = True  # an orphan or outdated pod went before the round acts
    assert not (await port.observe()).kept and sorted(asked) == ["ar", "sd"]


async def test_without_orders_since_the_kept_plan_every_worker_is_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kept = keep_readings(BEFORE, PODS, 0, time.monotonic())
    port, asked = _port(monkeypatch, kept)
    assert (await port.observe()).kept and asked == []
    assert not (await port.observe()).kept and sorted(asked) == ["ar", "sd"]
    # And after a sleep whose ACK has no device figures: read again too.
    port2, asked2 = _port(monkeypatch, kept)
    await port2.observe()
    bare = AckFacts("h1-sleep", True, "sleep", WorkerPhase.ASLEEP, level=1)
    port2._ordered, port2._acks = {"ar"}, {"ar": bare}
    await port2.observe()
    assert sorted(asked2) == ["ar", "sd"]


# -- the round: what it sends from kept readings --------------------------------------------


@dataclass
class KeptPort:
    """``a`` Active holds the device, ``b`` asleep asks for it; the first observe is from kept
    readings. ``both_asleep``: nothing is Active (the plan is a wake, not a sleep)."""

    both_asleep: bool = False
    calls: list[str] = field(default_factory=list)
    observed: int = 0
    phase: dict[str, WorkerPhase] = field(
        default_factory=lambda: {"a": WorkerPhase.ACTIVE, "b": WorkerPhase.ASLEEP}
    )

    def __post_init__(self) -> None:
        if self.both_asleep:
            self.phase["a"] = WorkerPhase.ASLEEP

    async def observe(self) -> GroupObservation:
        self.observed += 1
        self.calls.append("observe")
        used = {n: 12 * GIB if p is WorkerPhase.ACTIVE else 0 for n, p in self.phase.items()}
        intents = {
            "a": StageIntent("a", False, vram_request=12 * GIB),
            "b": StageIntent("b", True, vram_request=12 * GIB),
        }
        facts = {
            n: StageFacts(p, level=1 if p is WorkerPhase.ASLEEP else None, used_bytes=used[n])
            for n, p in self.phase.items()
        }
        free = TOTAL - GIB - sum(used.values())
        return GroupObservation(intents, facts, GroupMemory(TOTAL, free), kept=self.observed == 1)

    async def sleep(self, stage: str, level: int, task_id: str, **_: Any) -> AckFacts:
        self.calls.append(f"sleep {stage}")
        self.phase[stage] = WorkerPhase.ASLEEP
        return AckFacts(task_id, True, "sleep", WorkerPhase.ASLEEP, level=level)

    async def wake(self, stage: str, task_id: str) -> AckFacts:
        self.calls.append(f"wake {stage}")
        self.phase[stage] = WorkerPhase.ACTIVE
        return AckFacts(task_id, True, "wake", WorkerPhase.ACTIVE)

    async def checkpoint(self, outcome: RoundOutcome) -> None:
        self.calls.append("checkpoint")

    async def probe(self, stage: str) -> StageFacts:
        raise AssertionError("no probe here")

    async def start(self, stage: str) -> None:
        raise AssertionError("no pod is created here")

    async def fence(self, stage: str, reason: str) -> None:
        raise AssertionError("nothing is fenced here")


async def test_the_first_sleep_goes_out_from_kept_readings() -> None:
    port = KeptPort()
    out = await run_round(port, POLICY, lambda: "h1")
    # Before: the round read every worker before its sleep (a second observe first).
    assert port.calls == ["observe", "sleep a", "observe", "checkpoint", "wake b", "observe"]
    assert out.from_kept and list(out.wakes) == ["b"]


async def test_a_wake_is_never_decided_from_kept_readings() -> None:
    port = KeptPort(both_asleep=True)
    out = await run_round(port, POLICY, lambda: "h1")
    assert port.calls == ["observe", "observe", "wake b", "observe"]  # read before the wake
    assert not out.from_kept
