"""What the operator makes of a pre-warmed vLLM stage (issue 23): asleep at level 2 with nothing
on the device, it asks for memory like any loaded stage and is charged its engine's share; a
first wake whose engine cannot start holds its next wake back (the group's other stages go on),
and no order tries to bring it to the spec's level 1.

Real ``GroupRunner`` and ``KubeGroupPort`` (no API server: nothing here writes to it).
"""

from __future__ import annotations

from typing import Any

from omnistage_operator.api import conditions as cond
from omnistage_operator.api.spec_parse import parse_stage
from omnistage_operator.decisions.arbiter import (
    DeviceMemory,
    GroupMemory,
    StageFacts,
    WorkerPhase,
)
from omnistage_operator.decisions.arbiter.plan import plan
from omnistage_operator.decisions.facts import AckFacts
from omnistage_operator.decisions.handover import RoundOutcome
from omnistage_operator.k8s.port import KubeGroupPort
from omnistage_operator.k8s.settings import Settings
from omnistage_operator.runtime.runner import GroupRunner

ENGINE_FAILS = "No available memory for the cache blocks"
PREWARMED = StageFacts(WorkerPhase.ASLEEP, level=2, device_uuids=("GPU-0",))


def _body(name: str, backend: str, **spec: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "ns", "uid": f"u-{name}", "generation": 1},
        "spec": {
            "runner": "AR", "backend": backend, "image": "img", "model": {"path": "/models/m"},
            "colocation": {"group": "g"}, "state": "Active", "gpus": 1, **spec,
        },
    }  # fmt: skip


def _port(runner: GroupRunner, *bodies: dict[str, Any]) -> KubeGroupPort:
    port = KubeGroupPort(runner, "ns", "g")
    for body in bodies:
        name = body["metadata"]["name"]
        port.specs[name] = parse_stage(body)
        port.bodies[name] = body
    return port


def _runner() -> GroupRunner:
    return GroupRunner(object(), Settings())  # type: ignore[arg-type]


def test_a_prewarmed_vllm_stage_asks_and_is_charged_its_engines_share() -> None:
    runner = _runner()
    llm = _body("llm", "VLLM", vllm={"gpuMemoryUtilization": 0.3}, worker={"device": "cuda"})
    port = _port(runner, llm)
    intent = port._intent(port.specs["llm"], llm, PREWARMED)
    assert intent.want_active and intent.memory_share == 0.3
    # Not loaded yet (pod starting): no ask, as for any backend (it used to ask while absent).
    starting = port._intent(port.specs["llm"], llm, StageFacts(WorkerPhase.STARTING))
    assert not starting.want_active
    torch = _body("dit", "Transformers")
    dit = _port(runner, torch)
    assert dit._intent(dit.specs["dit"], torch, PREWARMED).memory_share is None


def test_no_order_deepens_or_raises_a_prewarmed_stage_to_the_spec_level() -> None:
    """spec.sleepLevel 1, the worker asleep at 2: the arbiter orders nothing (there is no
    2 -> 1 while asleep, and vLLM has no 1 -> 2 either); the next sleep is at the spec's."""
    runner = _runner()
    llm = _body("llm", "VLLM", state="Asleep", sleepLevel=1, worker={"device": "cuda"})
    port = _port(runner, llm)
    intent = port._intent(port.specs["llm"], llm, PREWARMED)
    assert intent.sleep_level == 1 and not intent.want_active
    total = 16 << 30
    memory = GroupMemory(total, total, (DeviceMemory("GPU-0", total, total),))
    d = plan({"llm": intent}, {"llm": PREWARMED}, memory)
    assert d.sleep == () and d.wake == () and d.fence == ()


def test_a_failed_first_wake_holds_the_next_one_back() -> None:
    runner = _runner()
    llm = _body("llm", "VLLM", worker={"device": "cuda"}, vram={"request": "8Gi"})
    port = _port(runner, llm)
    port.facts["llm"] = PREWARMED
    ack = AckFacts(
        "h1-llm-wake", False, "wake", WorkerPhase.ASLEEP, level=2,
        error=f"wake from level 2 failed: {ENGINE_FAILS}",
    )  # fmt: skip
    outcome = RoundOutcome(wakes={"llm": ack}, wake_errors={"llm": ack.error})
    runner._remember("ns", outcome)
    runner._note_wake_oom(port, outcome)
    backoff = runner.wake_backoffs[("ns", "llm")]
    assert backoff.count == 1 and backoff.needed_bytes == 0
    reason, message = runner.wake_problems[("ns", "llm")]
    assert reason == cond.Reason.ACK_FAILED.value and ENGINE_FAILS in message
    intent = port._intent(port.specs["llm"], llm, PREWARMED)
    held = port._hold_wakes({"llm": intent})
    assert intent.want_active and not held["llm"].want_active and "llm" in port.wake_held

    # A second failure in a row doubles it; a wake that goes through ends it.
    runner._note_wake_oom(port, outcome)
    assert runner.wake_backoffs[("ns", "llm")].count == 2
    woke = AckFacts("h3-llm-wake", True, "wake", WorkerPhase.ACTIVE)
    runner._note_wake_oom(port, RoundOutcome(wakes={"llm": woke}))
    assert ("ns", "llm") not in runner.wake_backoffs
