"""The workers' ACKs kept over a run, and the spans in which each stage held device memory:
the judge of the leader tests' memory promise (two stages of a group never holding at once,
or, in overlapped mode, only a wake beside the sleep it replaces)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from omnistage_operator.decisions.arbiter import WorkerPhase
from omnistage_operator.decisions.facts import OVERLAPPED_SLEEP, AckFacts, WorkerReport


@dataclass
class Probe:
    """One GetStatus answer: the report and the highest epoch the worker obeyed."""

    report: WorkerReport
    epoch: int
    at: float


@dataclass
class HoldingLog:
    """Every distinct ACK the workers reported, and the memory each stage held over time.

    A stage holds memory from a (non-noop) wake's ``started_at`` to the next ok sleep's
    ``finished_at``, both on the worker's clock; a stage first seen Active holds it from the
    start. Two stages of the group holding at one instant is a violation."""

    first_phase: dict[str, WorkerPhase] = field(default_factory=dict)
    acks: dict[str, dict[str, AckFacts]] = field(default_factory=dict)
    samples: int = 0

    def record(self, stage: str, probe: Probe) -> None:
        self.samples += 1
        rep = probe.report
        self.first_phase.setdefault(stage, rep.phase)
        if rep.last_ack is not None and rep.last_ack.task_id:
            a = rep.last_ack
            self.acks.setdefault(stage, {})[f"{a.op}:{a.task_id}:{a.started_at}"] = a

    def intervals(self, stage: str, now: float) -> list[tuple[float, float]]:
        return [(start, end) for start, end, _, _ in self.holdings(stage, now)]

    def holdings(self, stage: str, now: float) -> list[Holding]:
        """Each span ``stage`` held memory: from its wake's start to its sleep's end, with the
        two task ids ("" for a stage first seen Active, or one still holding)."""
        since: tuple[float, str] | None = (
            (float("-inf"), "") if self.first_phase.get(stage) is WorkerPhase.ACTIVE else None
        )
        out: list[Holding] = []
        for a in sorted(self.acks.get(stage, {}).values(), key=lambda a: a.started_at):
            if not a.ok or a.noop or a.replayed:
                continue
            if a.op == "wake" and since is None:
                since = (a.started_at, a.task_id)
            elif a.op == "sleep" and since is not None:
                out.append((since[0], a.finished_at, since[1], a.task_id))
                since = None
        if since is not None:
            out.append((since[0], now, since[1], ""))
        return out

    def overlaps(
        self, stages: list[str], *, beside: bool = False
    ) -> list[tuple[str, str, tuple[float, float]]]:
        """Instants at which two stages held memory at once (empty: never). ``beside``: an
        overlapped hand-over's span is allowed, from the wake beside a sleep to that sleep's
        end, both ordered in one hand-over (the device's own figures judge it: the caller's
        sampler)."""
        now = time.time() + 3600
        found = []
        for i, a in enumerate(stages):
            for b in stages[i + 1 :]:
                for s1, e1, wake1, sleep1 in self.holdings(a, now):
                    for s2, e2, wake2, sleep2 in self.holdings(b, now):
                        lo, hi = max(s1, s2), min(e1, e2)
                        if lo >= hi:
                            continue
                        if beside and (
                            ((lo, hi) == (s2, e1) and _beside(sleep1, a, wake2, b))
                            or ((lo, hi) == (s1, e2) and _beside(sleep2, b, wake1, a))
                        ):
                            continue
                        found.append((a, b, (lo, hi)))
        return found


Holding = tuple[float, float, str, str]  # start, end, the wake's task id, the sleep's


def _beside(sleep_id: str, sleeper: str, wake_id: str, waker: str) -> bool:
    """Whether ``waker``'s wake ran beside ``sleeper``'s overlapped sleep of one hand-over
    (task ids ``{hid}-{sleeper}-sleep{level}...-overlapped`` and ``{hid}-{waker}-wake-beside``)."""
    if not sleep_id.endswith(OVERLAPPED_SLEEP) or f"-{waker}-wake-beside" not in wake_id:
        return False
    return (
        sleep_id.split(f"-{sleeper}-sleep", maxsplit=1)[0]
        == wake_id.split(f"-{waker}-wake-beside", maxsplit=1)[0]
    )


def handed_over(sleeper: str, sleep: AckFacts, waker: str, wake: AckFacts) -> bool:
    """Whether ``waker``'s wake came after ``sleeper``'s sleep ACK (serial), or beside that
    sleep in one overlapped hand-over (the device's own figures judge that one)."""
    return sleep.finished_at < wake.started_at or _beside(
        sleep.task_id, sleeper, wake.task_id, waker
    )
