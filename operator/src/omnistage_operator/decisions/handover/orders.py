"""One order of a round carried out: a sleep (retries, drain wait, then a fence), a fence or a
wake."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from typing import Any

from omnistage_operator.decisions.arbiter import FenceOrder, SleepOrder, WorkerPhase
from omnistage_operator.decisions.facts import AckFacts, ack_contradiction
from omnistage_operator.decisions.handover import (
    FenceFailed,
    FenceResult,
    GroupPort,
    Refusal,
    RoundPolicy,
    SleepResult,
    WorkerRefused,
    WorkerUnavailable,
)
from omnistage_operator.decisions.leadership import LeadershipLost

log = logging.getLogger(__name__)


def _refusal_failed(refusal: Refusal | None) -> bool:
    """The refusal says the worker FAILED."""
    return refusal is not None and refusal.worker_failed


def _retry_id(base: str, n: int) -> str:
    return base if n == 0 else f"{base}-r{n}"


def drain_bound(order: SleepOrder, policy: RoundPolicy) -> float:
    """The longest a sleep that drains requests is waited for: its drain timeout and the
    transition's allowance."""
    drain = order.drain_timeout_s
    if drain is None:
        drain = policy.default_drain_timeout_s
    return drain + policy.transition_allowance_s


async def _sleep_or_fence(
    port: GroupPort, order: SleepOrder, base_id: str, policy: RoundPolicy
) -> SleepResult:
    began = time.monotonic()
    bound = drain_bound(order, policy)
    timeout = bound if order.inflight_requests > 0 else policy.transition_allowance_s
    ack: AckFacts | None = None
    refusal: Refusal | None = None
    contradiction = ""
    drained = False
    ids: list[str] = []
    renewals = 0  # not-ok ACKs so far: each retry after one goes under a new task id
    task_id = base_id
    attempts = 0
    attempt = 0

    def result(**kw: object) -> SleepResult:
        return SleepResult(
            order, task_id, ack, attempts, seconds=time.monotonic() - began,
            task_ids=tuple(ids), refusal=refusal, contradiction=contradiction, drained=drained,
            **kw,  # type: ignore[arg-type]
        )  # fmt: skip

    while True:
        attempts += 1
        if task_id not in ids:
            ids.append(task_id)
        log.info(
            "sleep %s: level %d to %s (attempt %d)", task_id, order.level, order.stage, attempts
        )
        lost = False
        try:
            ack = await port.sleep(
                order.stage, order.level, task_id, drain_timeout_s=order.drain_timeout_s,
                timeout_s=max(0.0, min(timeout, bound - (time.monotonic() - began)))
                or policy.transition_allowance_s, components=order.components,
            )  # fmt: skip
        except WorkerRefused as exc:
            refusal = exc.refusal
            log.warning("sleep %s of %s refused: %s", task_id, order.stage, exc)
            if refusal.stale_epoch:
                raise LeadershipLost(f"{order.stage} refused sleep {task_id}: {exc}") from exc
            if refusal.worker_failed or order.components:
                break  # a FAILED worker refuses every transition: fence it now
        except WorkerUnavailable as exc:
            lost = True
            log.warning("sleep %s of %s: no ACK (%s)", task_id, order.stage, exc)
            if order.releases_memory and time.monotonic() - began < bound:
                facts = await port.probe(order.stage)
                if facts.phase is WorkerPhase.SLEEPING and facts.inflight_requests > 0:
                    drained = True  # still draining within its drain timeout: wait, no fence
                    attempts -= 1
                    await asyncio.sleep(min(policy.backoff_s, 1.0))
                    timeout = bound
                    continue
        else:
            if ack.ok:
                why = ack_contradiction(ack, order.held, order.context_bytes)
                if why is None:
                    return result()
                contradiction = why
                log.warning("sleep %s of %s: %s", task_id, order.stage, why)
                break  # retrying only replays (or no-ops) the lie: fence
            log.warning("sleep %s of %s: ACK not ok: %s", task_id, order.stage, ack.error)
            renewals += 1
            task_id = _retry_id(base_id, renewals)
        within_window = lost and time.monotonic() - began < policy.retry_window_s
        if attempts >= max(1, policy.ack_retries) and not within_window:
            break
        await asyncio.sleep(min(policy.backoff_s * (2**attempt), 5.0))
        attempt += 1
    if not order.releases_memory or (order.components and not _refusal_failed(refusal)):
        # A 1->2 deepening of a stage that holds no memory: nothing to protect by fencing. A
        # component sleep that did not go through leaves an Active worker that reports its
        # footprint: it is not counted as freed (no ok ACK), and nothing is fenced.
        return result()
    reason = result().message
    try:
        await port.fence(order.stage, f"sleep {task_id} failed after {attempts} attempts: {reason}")
    except FenceFailed as exc:
        return result(fence_error=str(exc) or "fence not confirmed")
    return result(fenced=True)


async def _fence(port: GroupPort, order: FenceOrder) -> FenceResult:
    try:
        await port.fence(order.stage, f"{order.reason.value}: {order.message}")
    except FenceFailed as exc:
        return FenceResult(order, False, str(exc) or "fence not confirmed")
    return FenceResult(order, True)


async def _wake(
    port: GroupPort, stage: str, task_id: str, policy: RoundPolicy
) -> AckFacts | Refusal | str:
    last = "no wake ACK"
    for attempt in range(max(1, policy.ack_retries)):
        log.info("wake %s: to %s (attempt %d)", task_id, stage, attempt + 1)
        try:
            return await port.wake(stage, task_id)
        except WorkerRefused as exc:
            log.warning("wake %s of %s refused: %s", task_id, stage, exc)
            if exc.refusal.stale_epoch:
                raise LeadershipLost(f"{stage} refused wake {task_id}: {exc}") from exc
            return exc.refusal  # deliberate: not asked again in this round
        except WorkerUnavailable as exc:
            last = f"no wake ACK: {exc}"
            log.warning("wake %s of %s: %s", task_id, stage, last)
        if attempt + 1 < policy.ack_retries:
            await asyncio.sleep(policy.backoff_s * (2**attempt))
    return last


def _failure(stage: str, what: str, exc: Exception) -> str:
    """One stage's unexpected error as a message (``LeadershipLost`` is never caught)."""
    if isinstance(exc, LeadershipLost):
        raise exc
    log.exception("%s of %s failed; the group's other stages go on", what, stage)
    return f"{what} failed: {type(exc).__name__}: {exc}"


async def _guarded_sleep(
    order: SleepOrder, base_id: str, work: Coroutine[Any, Any, SleepResult]
) -> SleepResult:
    """``work`` (the sleep of ``order``), its unexpected error turned into its result."""
    try:
        return await work
    except Exception as exc:  # isolated per stage, reported on its resource
        return SleepResult(order, base_id, None, 1, error=_failure(order.stage, "sleep", exc))
