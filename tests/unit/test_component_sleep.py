"""Component-level sleep on the operator's side: the arbiter's component orders, the round
against a simulated group (a partly asleep diffusion stage makes room for a second stage), and
the status figures and condition."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

import pytest

from omnistage_operator.api.spec_parse import parse_stage
from omnistage_operator.decisions.arbiter import (
    BlockReason,
    ComponentFacts,
    GroupMemory,
    Handover,
    StageFacts,
    StageIntent,
    WorkerPhase,
)
from omnistage_operator.decisions.arbiter.demand import footprint
from omnistage_operator.decisions.arbiter.plan import plan
from omnistage_operator.decisions.component_status import component_status, components_verdict
from omnistage_operator.decisions.facts import AckFacts
from omnistage_operator.decisions.handover import (
    GroupObservation,
    RoundOutcome,
    RoundPolicy,
    WorkerRefused,
)
from omnistage_operator.decisions.handover.rounds import run_round

GI = 1 << 30
CAP = 16 * GI
ENCODERS = ("text_encoder", "text_encoder_2")


def painter(asleep: tuple[str, ...] = ()) -> StageFacts:
    """An Active diffusion worker: two 3 GiB encoders and a 6 GiB transformer."""
    sizes = {"text_encoder": 3 * GI, "text_encoder_2": 3 * GI, "transformer": 6 * GI}
    comps = tuple(
        ComponentFacts(n, b, 0 if n in asleep else b, 1 if n in asleep else None)
        for n, b in sizes.items()
    )
    used = sum(c.device_bytes for c in comps)
    return StageFacts(
        WorkerPhase.ACTIVE, used_bytes=used, active_footprint=used, peak_active=used,
        components=comps,
    )  # fmt: skip


def intents(want: tuple[str, ...], *, b_wants: bool = True) -> dict[str, StageIntent]:
    return {
        "a": StageIntent("a", True, priority=1, asleep_components=frozenset(want)),
        "b": StageIntent("b", b_wants, vram_request=8 * GI),
    }


def memory(used: int) -> GroupMemory:
    return GroupMemory(CAP, CAP - used)


B_ASLEEP = StageFacts(WorkerPhase.ASLEEP, level=1)


def test_spec_asks_components_asleep_so_a_component_sleep_is_ordered() -> None:
    d = plan(intents(ENCODERS), {"a": painter(), "b": B_ASLEEP}, memory(12 * GI))
    (order,) = d.sleep
    assert order.stage == "a" and order.components == ENCODERS and order.level == 1
    assert "a" in d.holder_sleeps  # every wake of the hand-over waits for its ACK
    assert d.admitted == ("a",) and d.wake == ()
    assert d.waiting["b"][0].reason is BlockReason.MEMORY_CLAIMED


def test_second_stage_waits_for_the_partial_sleep_ack() -> None:
    # The worker already reports the smaller footprint, but the ACK of this hand-over's
    # component sleep is outstanding: no wake.
    facts = {"a": painter(ENCODERS), "b": B_ASLEEP}
    pending = Handover("h1", sleepers=frozenset({"a"}))
    d = plan(intents(ENCODERS), facts, memory(6 * GI), pending)
    assert d.admitted == ("a", "b") and d.wake == ()
    assert d.waiting["b"][0].reason is BlockReason.AWAITING_ACK
    acked = Handover("h1", sleepers=frozenset({"a"}), acked=frozenset({"a"}))
    d = plan(intents(ENCODERS), facts, memory(6 * GI), acked)
    assert d.wake == ("b",) and d.sleep == ()


def test_component_wake_waits_for_room_and_sends_nobody_to_sleep() -> None:
    b_active = StageFacts(WorkerPhase.ACTIVE, used_bytes=8 * GI, active_footprint=8 * GI)
    facts = {"a": painter(ENCODERS), "b": b_active}
    d = plan(intents(()), facts, memory(14 * GI))
    assert d.component_wakes == () and d.sleep == ()
    (blocker,) = d.components_waiting["a"]
    assert blocker.reason is BlockReason.NO_ROOM and "takes 6Gi" in blocker.message
    # Once b sleeps (its spec says Asleep), the encoders wake.
    d = plan(intents((), b_wants=False), {"a": painter(ENCODERS), "b": B_ASLEEP}, memory(6 * GI))
    assert d.component_wakes == ("a",) and d.components_waiting == {}


def test_a_full_wake_is_charged_every_component() -> None:
    # Put to sleep whole after a partial sleep: its measured footprint is the partial one, but
    # a wake makes every component resident.
    partial = painter(ENCODERS)
    asleep = StageFacts(
        WorkerPhase.ASLEEP, level=1, active_footprint=partial.active_footprint,
        context_bytes=GI // 2,
        components=tuple(replace(c, device_bytes=0, level=1) for c in partial.components),
    )  # fmt: skip
    assert footprint(intents(ENCODERS)["a"], asleep) == 12 * GI + GI // 2
    assert footprint(intents(ENCODERS)["a"], partial) == 6 * GI  # Active: what stays resident


def test_unknown_component_names_are_not_ordered() -> None:
    d = plan(intents(("vae_decoder",)), {"a": painter(), "b": B_ASLEEP}, memory(12 * GI))
    assert d.sleep == ()
    (blocker,) = d.components_waiting["a"]
    assert blocker.reason is BlockReason.UNKNOWN_COMPONENTS
    assert "vae_decoder" in blocker.message and "transformer" in blocker.message


@dataclass
class Group:
    """A simulated group: a's components and b's weights on one device of ``CAP`` bytes."""

    want: tuple[str, ...]
    a_asleep: set[str] = field(default_factory=set)
    b_awake: bool = False
    refuse: str | None = None  # the code a's component sleep is refused with
    not_ok: bool = False  # a's component sleep ACKs not ok
    peak: int = 0
    calls: list[str] = field(default_factory=list)

    def used(self) -> int:
        facts = painter(tuple(sorted(self.a_asleep)))
        return facts.used_bytes + (8 * GI if self.b_awake else 0)

    def _check(self) -> None:
        self.peak = max(self.peak, self.used())
        assert self.used() <= CAP, f"device over capacity: {self.used()}"

    async def observe(self) -> GroupObservation:
        b = (
            StageFacts(WorkerPhase.ACTIVE, used_bytes=8 * GI, active_footprint=8 * GI)
            if self.b_awake
            else B_ASLEEP
        )
        facts = {"a": painter(tuple(sorted(self.a_asleep))), "b": b}
        return GroupObservation(intents(self.want), facts, memory(self.used()))

    async def start(self, stage: str) -> None:
        raise AssertionError("no pod is started")

    async def probe(self, stage: str) -> StageFacts:
        return (await self.observe()).facts[stage]

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
        self.calls.append(f"sleep {stage} {','.join(components)}")
        assert stage == "a" and components
        if self.refuse is not None:
            raise WorkerRefused(self.refuse, "components: no component 'x'")
        if self.not_ok:
            return AckFacts(task_id, False, "sleep", WorkerPhase.ACTIVE, error="copy failed")
        before = self.used()
        self.a_asleep |= set(components)
        return AckFacts(
            task_id, True, "sleep", WorkerPhase.ACTIVE, freed_bytes=before - self.used()
        )

    async def wake(self, stage: str, task_id: str) -> AckFacts:
        self.calls.append(f"wake {stage}")
        if stage == "a":
            self.a_asleep.clear()
        else:
            self.b_awake = True
        self._check()
        return AckFacts(task_id, True, "wake", WorkerPhase.ACTIVE)

    async def fence(self, stage: str, reason: str) -> None:
        raise AssertionError(f"{stage} fenced: {reason}")

    async def checkpoint(self, outcome: RoundOutcome) -> None:
        return None


async def rounds(group: Group, n: int = 4) -> list[RoundOutcome]:
    ids = itertools.count()
    policy = RoundPolicy(ack_retries=2, backoff_s=0.0)
    return [await run_round(group, policy, lambda: f"h{next(ids)}") for _ in range(n)]


async def test_round_sleeps_the_encoders_then_wakes_the_second_stage() -> None:
    group = Group(ENCODERS)
    first = (await rounds(group, 1))[0]
    assert group.calls == ["sleep a text_encoder,text_encoder_2", "wake b"]
    assert first.sleeps[0].task_id.endswith("-parts") and first.sleeps[0].ok
    assert group.b_awake and group.peak <= CAP
    # The spec drops the encoders from asleepComponents: no room while b is Active.
    group.want = ()
    await rounds(group, 2)
    assert group.a_asleep == set(ENCODERS) and group.calls[-1] == "wake b"


@pytest.mark.parametrize("how", ["refused", "not_ok"])
async def test_failed_component_sleep_is_not_freed_and_not_fenced(how: str) -> None:
    group = Group(ENCODERS, refuse="INVALID_ARGUMENT" if how == "refused" else None)
    group.not_ok = how == "not_ok"
    out = (await rounds(group, 1))[0]
    assert not out.sleeps[0].ok and not out.sleeps[0].fenced
    assert not group.b_awake and "wake b" not in group.calls


def test_status_figures_and_condition() -> None:
    comps = painter(("text_encoder",)).components
    figures = component_status(comps)
    assert figures is not None
    assert figures[0] == {
        "name": "text_encoder", "weightsBytes": 3 * GI, "deviceBytes": 0,
        "weights": "3Gi", "state": "Asleep", "level": 1,
    }  # fmt: skip
    assert figures[2]["state"] == "Resident"
    assert component_status(()) is None
    ok, reason, message = components_verdict(["text_encoder"], WorkerPhase.ACTIVE, comps) or (
        False, "", "",
    )  # fmt: skip
    assert ok and reason == "ComponentsAsleep" and "text_encoder" in message
    pending = components_verdict(ENCODERS, WorkerPhase.ACTIVE, comps)
    assert pending is not None and pending[:2] == (False, "ComponentsPending")
    refused = components_verdict(
        ENCODERS, WorkerPhase.ACTIVE, comps, problem=("SleepRefused", "no component 'x'")
    )
    assert refused == (False, "SleepRefused", "no component 'x'")
    assert components_verdict((), WorkerPhase.ACTIVE, painter().components) is None


def test_spec_reads_asleep_components() -> None:
    spec: dict[str, object] = {
        "runner": "Diffusion",
        "backend": "Diffusers",
        "model": {"path": "/m"},
        "image": "i",
        "colocation": {"group": "g"},
        "asleepComponents": ["text_encoder_2", "text_encoder"],
    }
    body = {"metadata": {"name": "p", "namespace": "n", "uid": "u", "generation": 1}, "spec": spec}
    assert parse_stage(body).asleep_components == ENCODERS
    del spec["asleepComponents"]
    assert parse_stage(body).asleep_components == ()
