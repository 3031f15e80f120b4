"""The overlapped hand-over (issue 23): the sleep of the stage that must give its device up
streams each piece it releases, and the wake of the stage the arbiter would wake next runs
beside it under a claim limit, raised by each measured release.

The promise is kept piece by piece: the woken worker never holds more device memory than the
limit (its worker enforces it: ``WakeUpRequest.claim_limit_bytes``), and the limit is what it
held plus the device's free memory (less the margin) measured before the sleep began, plus what
the sleeping worker has measured released (each ``MemoryReleased``, then its ok ACK's
``freed_bytes``). That free memory is the round's own reading when it read the workers, else (a
round planned from kept readings) the sleeping worker's, sent as its stream's first message
(:class:`RoomBeside`); a worker that sends none gives the wake only what it releases. The
device's own figures judge that ACK once the wake has ended (``facts.ack_contradiction`` with
``beside``: from the sleep's start to the later of the two ends, what the wake took meanwhile
counted as the sleep's): a contradicted ACK gets its stage fenced, as a serial one does. The
sleep's task id ends in ``facts.OVERLAPPED_SLEEP``: later readings of its ACK judge only what
the worker holds asleep.

- :func:`pair_wake` (pure) decides whether a round's sleep may carry a wake: the arbiter itself,
  asked with the sleeper already asleep (its context left on the device), must wake exactly one
  stage on the same single device and order nothing else. Only a whole-model sleep with no
  request in flight is overlapped, and only when both workers say they can take part
  (``GetStatus.claim_limits``: an older worker, a vLLM one, or one whose engine does not take
  memory piece by piece, does not); everything else goes the serial way. When both also say
  they hand pieces over (``GetStatus.handoff``: they share a hand-off directory on the node),
  the sleep's pieces go to the wake on a channel named after it instead of being freed; each
  is still taken only under the limit.
- :func:`sleep_beside_wake` runs it against a port that can (:class:`OverlapPort`). When the
  streamed sleep does not end in an ok ACK, the wake gets no further raise (its worker gives up
  after its claim wait and goes back to sleep) and the sleep goes on the ordinary way, under the
  plain task id (``orders._sleep_or_fence``: retries, then a fence).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Protocol, runtime_checkable

from omnistage_operator.decisions.arbiter import (
    DeviceMemory,
    GroupMemory,
    Handover,
    SleepOrder,
    StageFacts,
    WorkerPhase,
)
from omnistage_operator.decisions.arbiter.plan import plan
from omnistage_operator.decisions.facts import (
    OVERLAPPED_SLEEP,
    AckFacts,
    RoomBeside,
    ack_contradiction,
)
from omnistage_operator.decisions.handover import (
    FenceFailed,
    GroupObservation,
    GroupPort,
    Refusal,
    RoundPolicy,
    SleepResult,
    WakeBeside,
    WorkerRefused,
    WorkerUnavailable,
)
from omnistage_operator.decisions.handover.orders import _sleep_or_fence, drain_bound
from omnistage_operator.decisions.leadership import LeadershipLost

__all__ = ["OverlapPort", "Pairing", "handoff_channel", "pair_wake", "sleep_beside_wake"]

log = logging.getLogger(__name__)


@runtime_checkable
class OverlapPort(Protocol):
    """What an overlapped hand-over needs of a port beside ``GroupPort``."""

    def sleep_stream(
        self, stage: str, level: int, task_id: str, *, timeout_s: float, handoff_channel: str = ""
    ) -> AsyncIterator[int | RoomBeside | AckFacts]:
        """SleepStream: the room beside the sleeper measured before it began (where its worker
        sends one), the bytes released so far after each piece, then the ACK (last); its
        pieces handed over on ``handoff_channel`` (empty: freed)."""
        ...

    async def wake_limited(
        self, stage: str, task_id: str, claim_limit_bytes: int, handoff_channel: str = ""
    ) -> AckFacts:
        """WakeUp under a claim limit (raises as ``GroupPort.wake`` does), taking the pieces
        handed over on ``handoff_channel`` where it can."""
        ...

    async def raise_claim_limit(self, stage: str, task_id: str, claim_limit_bytes: int) -> None:
        """RaiseClaimLimit of the wake ``task_id``."""
        ...


@dataclass(frozen=True)
class Pairing:
    """The wake a sleep carries: its stage and its first claim limit (bytes); with
    ``room_from_stream`` (planned from kept readings) the room beside the sleeper is not in it
    and comes from the sleep's own first report."""

    stage: str
    first_limit_bytes: int
    room_from_stream: bool = False
    handoff: bool = False
    """Both workers hand pieces over (``GetStatus.handoff``): the sleep's pieces go to the
    wake on a channel named after it (:func:`handoff_channel`) instead of being freed."""


def pair_wake(
    obs: GroupObservation, order: SleepOrder, handover: Handover | None, policy: RoundPolicy
) -> Pairing | None:
    """The wake ``order``'s sleep may carry, or None (the module's docstring says when)."""
    x = obs.facts.get(order.stage)
    intent = obs.intents.get(order.stage)
    if (
        x is None
        or intent is None
        or not order.releases_memory
        or order.components
        or order.inflight_requests
        or x.phase is not WorkerPhase.ACTIVE
        or not x.claim_limits
        or x.context_bytes is None
        or len(x.device_uuids) > 1
    ):
        return None
    asleep = _asleep(x, order.level, x.context_bytes)
    memory = _freed(obs.memory, x, x.context_bytes)
    if memory is None:
        return None
    if handover is None:
        handover = Handover("overlap")
    then = plan(
        obs.intents,
        {**obs.facts, order.stage: asleep},
        memory,
        replace(
            handover,
            sleepers=handover.sleepers | {order.stage},
            acked=handover.acked | {order.stage},
        ),
        margin_bytes=policy.margin_bytes,
    )
    if then.sleep or then.fence or then.component_wakes or len(then.wake) != 1:
        return None
    name = then.wake[0]
    y = obs.facts[name]
    if (
        obs.intents[name].asleep_components
        or y.phase is not WorkerPhase.ASLEEP
        or not y.claim_limits
        or y.device_uuids != x.device_uuids
    ):
        return None
    handoff = x.handoff and y.handoff
    # Kept readings are a round old: the room beside the sleeper is then the sleeping worker's
    # own reading, taken before it releases anything (the stream's first report).
    if obs.kept:
        return Pairing(name, y.used_bytes, room_from_stream=True, handoff=handoff)
    free = _free_on(obs.memory, x.device_uuids)
    return Pairing(name, y.used_bytes + max(0, free - policy.margin_bytes), handoff=handoff)


def handoff_channel(wake_id: str) -> str:
    """The hand-off channel of the wake ``wake_id``: a name a worker takes whatever the task
    id holds (``WakeUpRequest.handoff_channel``), one per wake."""
    return "w" + hashlib.sha256(wake_id.encode()).hexdigest()[:24]


def _asleep(fact: StageFacts, level: int, context: int) -> StageFacts:
    """``fact`` once asleep at ``level``: its CUDA context is all it holds."""
    return replace(
        fact,
        phase=WorkerPhase.ASLEEP,
        level=level,
        used_bytes=context,
        device_used=dict.fromkeys(fact.device_used, context),
        device_held={},
        inflight_requests=0,
    )


def _freed(memory: GroupMemory, fact: StageFacts, context: int) -> GroupMemory | None:
    """``memory`` once ``fact``'s stage holds only its context (None: free not measured)."""
    if memory.free is None:
        return None
    if not memory.devices:
        return replace(memory, free=memory.free + max(0, fact.used_bytes - context))
    devices = tuple(
        DeviceMemory(d.uuid, d.total, d.free + max(0, fact.device_used.get(d.uuid, 0) - context))
        if d.uuid in fact.device_uuids
        else d
        for d in memory.devices
    )
    return replace(memory, devices=devices, free=min(d.free for d in devices))


def _free_on(memory: GroupMemory, uuids: tuple[str, ...]) -> int:
    """The measured free memory of the device ``uuids`` names (the group's, without GPUs)."""
    if not memory.devices:
        return memory.free or 0
    return next((d.free for d in memory.devices if d.uuid in uuids), 0)


class _Port(GroupPort, OverlapPort, Protocol):
    """A port that can run an overlapped hand-over."""


async def sleep_beside_wake(
    port: _Port,
    order: SleepOrder,
    task_id: str,
    policy: RoundPolicy,
    *,
    pairing: Pairing,
    wake_id: str,
) -> SleepResult:
    """Sleep ``order``'s stage streamed, with ``pairing``'s wake beside it (module docstring)."""
    began = time.monotonic()
    channel = handoff_channel(wake_id) if pairing.handoff else ""
    wake = asyncio.ensure_future(
        port.wake_limited(pairing.stage, wake_id, pairing.first_limit_bytes, channel)
    )
    wake.add_done_callback(_taken)  # its error is read even when nothing awaits it
    log.info(
        "overlapped hand-over %s: %s sleeps while %s wakes (%s) under a %d-byte limit%s",
        task_id, order.stage, pairing.stage, wake_id, pairing.first_limit_bytes,
        f", pieces handed over on {channel}" if channel else "",
    )  # fmt: skip
    ack: AckFacts | None = None
    released = 0
    base = pairing.first_limit_bytes  # what the wake may hold beyond the sleep's releases
    streamed = f"{task_id}{OVERLAPPED_SLEEP}"
    bound = drain_bound(order, policy)
    try:  # a paired sleep had no request in flight by its readings (pair_wake)
        stream = port.sleep_stream(
            order.stage,
            order.level,
            streamed,
            timeout_s=policy.transition_allowance_s,
            handoff_channel=channel,
        )
        async for event in stream:
            if isinstance(event, AckFacts):
                ack = event
            elif isinstance(event, RoomBeside):
                if pairing.room_from_stream and event.free_bytes > policy.margin_bytes:
                    base += event.free_bytes - policy.margin_bytes
                    await _raise(port, pairing, wake_id, base + released, wake)
            elif event > released:
                released = event
                await _raise(port, pairing, wake_id, base + released, wake)
    except (WorkerUnavailable, WorkerRefused) as exc:
        if isinstance(exc, WorkerRefused) and exc.refusal.stale_epoch:
            raise LeadershipLost(f"{order.stage} refused sleep {streamed}: {exc}") from exc
        log.warning("overlapped sleep %s of %s: %s", streamed, order.stage, exc)
        if isinstance(exc, WorkerUnavailable):
            ack = await _join_draining(port, order, streamed, bound - (time.monotonic() - began))
    if ack is None or not ack.ok:
        # No further raise: the wake waits out its worker's claim wait and goes back to sleep.
        log.warning(
            "overlapped sleep %s of %s not ACKed ok; the wake of %s gets no more room, and "
            "the sleep goes on the ordinary way", streamed, order.stage, pairing.stage,
        )  # fmt: skip
        return await _sleep_or_fence(port, order, task_id, policy)
    # The worker's own measured release (as each MemoryReleased was); the device's figures
    # judge it once the wake beside has ended (its growth meanwhile is not the sleep's).
    await _raise(port, pairing, wake_id, base + max(released, ack.freed_bytes), wake)
    woken = await _woken(wake, pairing.stage, wake_id)
    beside = WakeBeside(pairing.stage, wake_id, woken)
    result = SleepResult(
        order, streamed, ack, 1, seconds=time.monotonic() - began, task_ids=(streamed,),
        beside=beside,
    )  # fmt: skip
    why = ack_contradiction(
        ack, order.held, order.context_bytes,
        beside=woken if isinstance(woken, AckFacts) else None,
    )  # fmt: skip
    if why is None:
        return result
    log.warning("overlapped sleep %s of %s: %s", streamed, order.stage, why)
    return await _fenced(port, replace(result, contradiction=why))


async def _join_draining(
    port: GroupPort, order: SleepOrder, streamed: str, left_s: float
) -> AckFacts | None:
    """The Ack of a streamed sleep whose stream was cut off while its worker drains requests
    the round's readings did not show: the same task joined by a unary ``Sleep`` (the worker
    answers with that transition's Ack, drain timed), within what is left of the drain's bound;
    None when the worker is not draining or does not answer."""
    try:
        facts = await port.probe(order.stage)
        if facts.phase is not WorkerPhase.SLEEPING or facts.inflight_requests <= 0 or left_s <= 0:
            return None
        log.info("overlapped sleep %s of %s: draining; joined for %.0f s", streamed, order.stage,
                 left_s)  # fmt: skip
        return await port.sleep(
            order.stage, order.level, streamed, drain_timeout_s=order.drain_timeout_s,
            timeout_s=left_s,
        )  # fmt: skip
    except (WorkerUnavailable, WorkerRefused) as exc:
        log.warning("overlapped sleep %s of %s, joined: %s", streamed, order.stage, exc)
        return None


async def _fenced(port: GroupPort, result: SleepResult) -> SleepResult:
    """Fence the stage of a sleep whose ACK is not trusted (as ``orders`` fences one)."""
    reason = f"sleep {result.task_id} failed after 1 attempt: {result.message}"
    try:
        await port.fence(result.order.stage, reason)
    except FenceFailed as exc:
        return replace(result, fence_error=str(exc) or "fence not confirmed")
    return replace(result, fenced=True)


async def _raise(
    port: OverlapPort, pairing: Pairing, wake_id: str, limit: int, wake: asyncio.Future[AckFacts]
) -> None:
    """Raise the wake's limit; a raise that fails is logged (the sleep goes on regardless)."""
    if wake.done():
        return
    try:
        await port.raise_claim_limit(pairing.stage, wake_id, limit)
    except (WorkerUnavailable, WorkerRefused) as exc:
        log.warning("raise of %s's claim limit to %d: %s", pairing.stage, limit, exc)


async def _woken(
    wake: asyncio.Future[AckFacts], stage: str, wake_id: str
) -> AckFacts | Refusal | str:
    """How the wake beside the sleep ended (as ``orders._wake`` reports one attempt)."""
    try:
        return await wake
    except WorkerRefused as exc:
        if exc.refusal.stale_epoch:
            raise LeadershipLost(f"{stage} refused wake {wake_id}: {exc}") from exc
        return exc.refusal
    except WorkerUnavailable as exc:
        return f"no wake ACK: {exc}"


def _taken(wake: asyncio.Future[AckFacts]) -> None:
    """The wake's error marked read (a wake left to end on its own: the next round's GetStatus
    reads where it stands)."""
    if not wake.cancelled() and wake.exception() is not None:
        log.info("wake beside an overlapped sleep: %s", wake.exception())
