"""A hand-over round: executes the arbiter's decisions for one group (sleeps, ACK checks,
fencing, then wakes).

This package holds the round's vocabulary: the worker errors and refusals, the ``GroupPort`` a
round runs against, its policy and its results. :mod:`.rounds` runs one round (its steps in that
module's docstring); :mod:`.orders` carries out one sleep (retries, drain wait, fence), one fence
or one wake.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from omnistage_operator.api import conditions as cond
from omnistage_operator.decisions.arbiter import (
    Decision,
    FenceOrder,
    GroupMemory,
    SleepOrder,
    StageFacts,
    StageIntent,
)
from omnistage_operator.decisions.facts import AckFacts, memory_need

__all__ = [
    "FenceFailed",
    "FenceResult",
    "GroupObservation",
    "GroupPort",
    "Refusal",
    "RoundOutcome",
    "RoundPolicy",
    "SleepResult",
    "StageDeleting",
    "WakeBeside",
    "WorkerRefused",
    "WorkerUnauthenticated",
    "WorkerUnavailable",
]


class WorkerUnavailable(Exception):
    """The worker did not answer (unreachable, deadline exceeded, no pod address)."""


class StageDeleting(Exception):
    """``GroupPort.start`` found the stage being deleted: it created nothing (not an error)."""


class WorkerUnauthenticated(WorkerUnavailable):
    """The worker refused the operator's bearer token: for the hand-over it is unreachable
    (it may hold memory, so it is fenced in the end), and the stage's status says why."""


@dataclass(frozen=True)
class Refusal:
    """A worker's deliberate refusal: the gRPC status code's name and its message."""

    code: str  # "FAILED_PRECONDITION" | "INVALID_ARGUMENT" | "RESOURCE_EXHAUSTED" | ...
    message: str

    @property
    def worker_failed(self) -> bool:
        """The worker is FAILED (it refuses every transition; it holds memory until fenced)."""
        return "worker failed" in self.message

    @property
    def stale_epoch(self) -> bool:
        """The worker has obeyed a newer leader: this operator must stop ordering."""
        return "epoch" in self.message.lower()

    @property
    def need_bytes(self) -> int | None:
        """For a wake refused for lack of memory: the bytes it needs."""
        if self.code == "RESOURCE_EXHAUSTED" or "not enough" in self.message:
            return memory_need(f"not enough: {self.message}")
        return None


class WorkerRefused(Exception):
    """The worker answered with a deliberate refusal (FAILED_PRECONDITION, INVALID_ARGUMENT,
    RESOURCE_EXHAUSTED): not silence, so not retried as if the call was lost."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message

    @property
    def refusal(self) -> Refusal:
        """The refusal as data."""
        return Refusal(self.code, self.message)


class FenceFailed(Exception):
    """The pod could not be confirmed gone within the deadline."""


@dataclass(frozen=True)
class GroupObservation:
    """Everything the arbiter needs about one group, freshly read; ``kept``: the workers'
    facts are the group's readings from its last round (``readings.KeptReadings``), good for
    sending sleeps only (the next observe reads the workers unless those sleeps' ACKs say where
    the group stands)."""

    intents: Mapping[str, StageIntent]
    facts: Mapping[str, StageFacts]
    memory: GroupMemory
    kept: bool = False


class GroupPort(Protocol):
    """The side effects a round needs; implemented for Kubernetes and for the simulator."""

    async def observe(self) -> GroupObservation:
        """Read specs, pods and every reachable worker's GetStatus (within a round, a port may
        answer from the round's own ACKs where they prove where the group stands:
        ``readings.reuse_reports``; a round's first observe may answer from the group's kept
        readings, marked ``kept``)."""
        ...

    async def start(self, stage: str) -> None:
        """Create the stage's children; the worker pod starts asleep (a vLLM stage's
        pre-warmed at level 2). Raises :class:`StageDeleting` for a stage being deleted."""
        ...

    async def probe(self, stage: str) -> StageFacts:
        """GetStatus of one worker as the arbiter's facts (UNREACHABLE when it does not answer);
        used while a sleep is out, to tell a draining worker from a lost one."""
        ...

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
        """Call Sleep (``drain_timeout_s`` and ``components`` go in the request; ``timeout_s``
        is the call's deadline); raises ``WorkerUnavailable`` when no ACK comes,
        ``WorkerRefused`` when the worker refuses."""
        ...

    async def wake(self, stage: str, task_id: str) -> AckFacts:
        """Call WakeUp; raises ``WorkerUnavailable`` when no ACK comes, ``WorkerRefused`` when
        the worker refuses (RESOURCE_EXHAUSTED: not enough memory, its need in the message)."""
        ...

    async def fence(self, stage: str, reason: str) -> None:
        """Delete the stage's pod and return once the API confirms it is gone; raise
        ``FenceFailed`` when it is not confirmed in time (the fence then stays pending: the
        kube side persists it from ``RoundOutcome.fence_pending``)."""
        ...

    async def checkpoint(self, outcome: RoundOutcome) -> None:
        """The sleeps are ACKed: publish them (status) before any wake is sent (it may return
        once the writes are issued; the port keeps a later write of the same stage behind
        them)."""
        ...


@dataclass(frozen=True)
class RoundPolicy:
    """Retry, deadline and margin settings of a round."""

    ack_retries: int = 3
    backoff_s: float = 0.25
    margin_bytes: int = 0
    # Keep retrying a sleep that got no answer for at least this long before fencing (a worker
    # that refuses connections is usually still starting; a hung one uses up its deadlines).
    retry_window_s: float = 0.0
    # A sleep's ACK deadline: the transition allowance, plus the drain timeout when requests
    # are in flight (the stage's ``drain_timeout_s``, else this default: the worker's own).
    transition_allowance_s: float = 60.0
    default_drain_timeout_s: float = 600.0
    # With a group's ``SleepTracker``: how long a round waits for the sleeps it sent without
    # requests in flight (a draining one is never waited for: it runs on in the background).
    round_wait_s: float = 5.0
    # Overlapped hand-overs (``overlap``): a sleep that streams its releases, with the wake the
    # arbiter would order next running beside it under a claim limit raised by each release.
    overlapped: bool = False


@dataclass(frozen=True)
class WakeBeside:
    """The wake an overlapped sleep carried (``overlap``): its stage, task id and how it ended
    (its ACK, a refusal, or why no ACK came)."""

    stage: str
    task_id: str
    result: AckFacts | Refusal | str


@dataclass(frozen=True)
class SleepResult:
    """How one sleep order ended; ``reason``/``message`` are what a condition shows."""

    order: SleepOrder
    task_id: str  # the last task id sent
    ack: AckFacts | None  # the last ACK received, if any
    attempts: int
    fenced: bool = False
    fence_error: str = ""  # the fence was started and not confirmed: it is pending
    seconds: float = 0.0
    task_ids: tuple[str, ...] = ()  # every task id sent, in order (a not-ok ACK: a new one)
    refusal: Refusal | None = None  # the last deliberate refusal, if any
    contradiction: str = ""  # why an ok ACK was not trusted (the device's figures)
    drained: bool = False  # the round waited for the worker's drain of in-flight requests
    error: str = ""  # an unexpected exception ended the sleep (not ACKed, not fenced)
    beside: WakeBeside | None = None  # an overlapped sleep's wake, once it ended

    @property
    def ok(self) -> bool:
        """An ok ACK arrived and the device's own figures agree with it."""
        return self.ack is not None and self.ack.ok and not self.contradiction

    @property
    def fence_pending(self) -> bool:
        """A fence was started and not confirmed gone."""
        return bool(self.fence_error)

    @property
    def worker_s(self) -> float:
        """Time inside the worker: its drain plus its transition (the rest is the operator's)."""
        if self.ack is None:
            return 0.0
        return self.ack.duration_s + self.ack.drain_s

    @property
    def reason(self) -> cond.Reason:
        """A CamelCase reason for the stage's MemoryReleased condition and Events."""
        if self.ok:
            return cond.Reason.SLEEP_ACKNOWLEDGED
        if self.contradiction:
            return cond.Reason.ACK_CONTRADICTED
        if self.error:
            return cond.Reason.STAGE_ERROR
        if self.refusal is not None:
            if self.refusal.worker_failed:
                return cond.Reason.WORKER_FAILED
            return cond.Reason.SLEEP_REFUSED
        if self.ack is not None:
            return cond.Reason.ACK_FAILED
        return cond.Reason.ACK_TIMEOUT

    @property
    def message(self) -> str:
        """What happened, with the figures or the worker's own words."""
        if self.ok and self.ack is not None:
            return f"sleep {self.task_id} ACKed ok"
        if self.contradiction:
            why = self.contradiction
        elif self.error:
            why = f"sleep failed: {self.error}"
        elif self.refusal is not None:
            why = f"refused ({self.refusal.code}): {self.refusal.message}"
        elif self.ack is not None:
            why = f"ACK {self.ack.task_id} not ok: {self.ack.error}"
        else:
            why = "no sleep ACK"
        if self.fenced:
            return f"{why}; pod fenced (deleted, confirmed gone)"
        if self.fence_error:
            return f"{why}; fence pending: {self.fence_error}"
        return why


@dataclass(frozen=True)
class FenceResult:
    """How one fence order of the arbiter ended."""

    order: FenceOrder
    fenced: bool
    error: str = ""


@dataclass
class RoundOutcome:
    """What a round did, for status, events and metrics.

    The kube side persists ``fence_pending`` (fences started and not confirmed; cleared once the
    pod is confirmed gone) and ``learned_needs`` (bytes per stage, from wakes refused for lack
    of memory), and gives them back as ``StageFacts.fence_pending`` / ``learned_need``.
    """

    handover_id: str | None = None
    started: list[str] = field(default_factory=list)
    sleeps: list[SleepResult] = field(default_factory=list)
    fences: list[FenceResult] = field(default_factory=list)
    wakes: dict[str, AckFacts] = field(default_factory=dict)
    wake_errors: dict[str, str] = field(default_factory=dict)
    wake_refusals: dict[str, Refusal] = field(default_factory=dict)
    learned_needs: dict[str, int] = field(default_factory=dict)
    wake_oom: dict[str, AckFacts] = field(default_factory=dict)  # wakes out of device memory
    component_wakes: set[str] = field(default_factory=set)  # wakes of asleep components
    stage_errors: dict[str, str] = field(default_factory=dict)  # unexpected, per stage
    fence_pending: set[str] = field(default_factory=set)
    fence_confirmed: set[str] = field(default_factory=set)
    sleeps_running: frozenset[str] = frozenset()  # sleeps still out (draining) after the round
    handover_began: float | None = None  # monotonic: the hand-over's first order (maybe rounds ago)
    decision: Decision | None = None
    observation: GroupObservation | None = None
    from_kept: bool = False  # its sleeps went out from kept readings (``GroupObservation.kept``)

    @property
    def changed(self) -> bool:
        """Whether the round acted on anything."""
        return bool(
            self.started or self.sleeps or self.fences or self.wakes or self.wake_errors
            or self.stage_errors
        )  # fmt: skip
