"""Executes the arbiter's decisions for one group: sleeps, ACK checks, fencing, then wakes.

``run_round`` is written against ``GroupPort`` (observe, probe, start, sleep, wake, fence), so the
same code runs against real workers and the Kubernetes API (``port.KubeGroupPort``) and against
a simulated fleet in the property tests. One round:

1. observe every stage (GetStatus of every reachable worker, pods from the API) and plan; a
   first plan from the group's kept readings (``GroupObservation.kept``, ``readings``) goes on
   only when it puts every Active stage to sleep whole and orders nothing else, else the round
   reads every worker and plans again;
2. create the pods of stages that have none, asleep (a wake goes through the gate; no wake in a
   round that started pods, their contexts are not measured yet; a vLLM stage's pod is
   pre-warmed at level 2 and its engine starts at its first wake);
3. send every sleep order and every fence order concurrently. A sleep's ACK deadline is its
   drain timeout (when requests are in flight) plus the transition allowance; a sleep whose
   worker is still draining (Sleeping with requests in flight) is waited for up to that bound,
   never fenced. A sleep that gets no answer is retried with backoff under the same task id (it
   may have been delivered) for the retry window; a not-ok ACK is retried after backoff under a
   NEW task id (the worker replays a cached Ack for an old one); a deliberate refusal
   (``WorkerRefused``) is reported, not retried for a window (a FAILED worker is fenced at
   once, other refusals after the normal retries); an ok ACK the device's own figures
   contradict (``facts.ack_contradiction``) is not trusted: reported and fenced. Then the stage
   is fenced (pod deleted, deletion confirmed); a fence not confirmed stays pending (the kube
   side persists ``RoundOutcome.fence_pending``, and the arbiter keeps the gate closed).
   With ``RoundPolicy.overlapped``, a round's only order, a whole sleep with no request in
   flight, may carry the one wake the arbiter would order after it (``overlap``): that wake
   runs beside the sleep under a claim limit raised by each release, and its result is the
   round's (step 4 does not wake it again);
4. observe again and plan with this hand-over's bookkeeping (who had to sleep or be fenced, who
   ACKed ok, who was fenced); publish that (``checkpoint``: started, its status built and
   its writes sent, before the first wake; the kube side writes those stages again only after
   them, and answers them before its round ends), then wake what the arbiter now allows. A
   wake refused for lack of memory teaches the stage's need (``RoundOutcome.learned_needs``,
   persisted by the kube side and given back as ``StageFacts.learned_need``); it is not asked
   again until the memory is there, and never when the need exceeds the device
   (``LargerThanDevice``). A wake that ran out of memory during its
   copy (the room taken after the gate; the worker is back asleep and says how much more it
   needed: ``AckFacts.needed_bytes``) teaches the same, at least what the wake needed
   (``oom_need``), and is listed in ``RoundOutcome.wake_oom`` (the kube side backs off).

One stage's error never stops the others: an unexpected exception while starting, sleeping or
waking one stage is recorded for that stage (``RoundOutcome.stage_errors``, shown on its own
resource) and the round goes on; a sleep that raised counts as not ACKed, so the wake gate stays
closed. Only ``LeadershipLost`` ends the round.

Sleeps run as tasks of the group's ``sleep_tasks.SleepTracker``: with the runner's tracker a round
waits only for the sleeps it sent without requests in flight (at most ``round_wait_s``); a
draining sleep goes on in the background and a later round takes its result (steps 3 and 4 run
then), while the hand-over stays open: its sleepers without an ok ACK or a confirmed fence keep
every wake of the group closed, a stage with a sleep out gets no second order and no wake.

Callers serialize rounds per group (``GroupRunner``); nothing here is safe to run twice at once
for the same group.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import replace

from omnistage_operator.decisions.arbiter import (
    Decision,
    Handover,
    SleepOrder,
    StageFacts,
    WorkerPhase,
)
from omnistage_operator.decisions.arbiter.admission import claim_too_small
from omnistage_operator.decisions.arbiter.plan import plan
from omnistage_operator.decisions.facts import AckFacts, memory_need
from omnistage_operator.decisions.handover import (
    GroupObservation,
    GroupPort,
    Refusal,
    RoundOutcome,
    RoundPolicy,
    StageDeleting,
    WakeBeside,
)
from omnistage_operator.decisions.handover.orders import (
    _failure,
    _fence,
    _guarded_sleep,
    _sleep_or_fence,
    _wake,
)
from omnistage_operator.decisions.handover.overlap import OverlapPort, pair_wake, sleep_beside_wake
from omnistage_operator.decisions.handover.sleep_tasks import SleepTracker

log = logging.getLogger(__name__)


def oom_need(ack: AckFacts) -> int:
    """What a wake that ran out of device memory needs, in the units of a footprint (the sum
    over the stage's devices, its context included): what it holds asleep, plus the free
    memory it found, plus how much more it needed."""
    return ack.used_after_bytes + ack.free_after_bytes + ack.needed_bytes


async def _start(port: GroupPort, name: str, out: RoundOutcome) -> bool:
    """Create one stage's pod; an error is that stage's (recorded), not the round's. A stage
    being deleted gets nothing: no pod, no PodCreated Event, no status of a started stage."""
    try:
        await port.start(name)
    except StageDeleting:
        return False
    except Exception as exc:  # isolated per stage, reported on its resource
        out.stage_errors[name] = _failure(name, "start", exc)
        return False
    out.started.append(name)
    return True


def _remember(obs: GroupObservation, out: RoundOutcome) -> GroupObservation:
    """The observation with what this round learned and the kube side has not persisted yet."""
    facts = dict(obs.facts)
    for name, seen in obs.facts.items():
        fact = seen
        learned = out.learned_needs.get(name)
        pending = name in out.fence_pending and fact.phase is not WorkerPhase.ABSENT
        if learned is not None and (fact.learned_need or 0) < learned:
            fact = replace(fact, learned_need=learned)
        if pending and not fact.fence_pending:
            fact = replace(fact, fence_pending=True)
        facts[name] = fact
    return GroupObservation(obs.intents, facts, obs.memory)


def _plan(
    obs: GroupObservation,
    handover: Handover | None,
    policy: RoundPolicy,
    started: frozenset[str] = frozenset(),
) -> Decision:
    return plan(
        obs.intents, obs.facts, obs.memory, handover, margin_bytes=policy.margin_bytes,
        started=started,
    )  # fmt: skip


def _sleeps_only(obs: GroupObservation, decision: Decision) -> bool:
    """The plan puts every Active stage to sleep whole, every other stage is asleep, and it
    orders nothing else (no fence, no pod to create, no component order): what a round may
    send from kept readings."""
    if not decision.sleep or decision.fence or decision.component_wakes:
        return False
    ordered = {o.stage for o in decision.sleep}
    for o in decision.sleep:
        if not o.releases_memory or o.components:
            return False
    for name, fact in obs.facts.items():
        want = WorkerPhase.ACTIVE if name in ordered else WorkerPhase.ASLEEP
        if fact.phase is not want:
            return False
    return ordered <= set(obs.facts)


def _sleep_id(hid: str, order: SleepOrder) -> str:
    parts = "-parts" if order.components else ""
    return f"{hid}-{order.stage}-sleep{order.level}{parts}"


async def run_round(
    port: GroupPort,
    policy: RoundPolicy,
    new_id: Callable[[], str],
    tracker: SleepTracker | None = None,
) -> RoundOutcome:
    """Observe, sleep or fence what must release memory, then wake what the arbiter allows.

    ``tracker``: the group's sleeps in flight across rounds (``sleep_tasks``); without one, the
    round waits for every sleep it sent."""
    tracker = tracker if tracker is not None else SleepTracker(background=False)
    out = RoundOutcome()
    done = tracker.collect()  # sleeps that ended since the last round
    tracker.record(done, [])
    if not done:
        tracker.close_if_idle()  # e.g. a round ended by LeadershipLost before it closed it
    obs = await port.observe()
    decision = _plan(obs, tracker.handover(), policy)
    overlapping = policy.overlapped and isinstance(port, OverlapPort)
    if obs.kept and (done or tracker.running or not _sleeps_only(obs, decision)):
        # Kept readings send whole sleeps of every Active stage only: anything else is
        # decided from the workers' answers. A lone sleep may carry an overlapped wake planned
        # from them: the room beside it is its worker's reading before it begins
        # (``overlap.Pairing.room_from_stream``), not a second round of readings.
        obs = await port.observe()
        decision = _plan(obs, tracker.handover(), policy)
    out.from_kept = obs.kept

    for name, intent in sorted(obs.intents.items()):
        absent = obs.facts.get(name, StageFacts(WorkerPhase.ABSENT)).phase is WorkerPhase.ABSENT
        # no pod on a claim that cannot hold it: its worker could not see its devices
        fits = claim_too_small(intent, obs.memory) is None
        if absent and fits:
            await _start(port, name, out)
    started = frozenset(out.started)
    if started:
        decision = _plan(obs, tracker.handover(), policy, started)

    handover: Handover | None = tracker.handover()
    checkpoint: asyncio.Future[None] | None = None
    busy = tracker.running  # a stage with a sleep in flight gets no second order
    sleeps = [o for o in decision.sleep if o.stage not in busy]
    fences = [o for o in decision.fence if o.stage not in busy]
    if sleeps or fences or done or busy:
        hid = tracker.open(new_id() if handover is None else handover.id)
        out.handover_id = hid
        tracker.fences(fences)
        pairing = None
        if overlapping and len(sleeps) == 1:
            alone = not (fences or done or busy or started or decision.wake)
            pairing = pair_wake(obs, sleeps[0], tracker.handover(), policy) if alone else None
        for order in sleeps:
            task_id = tracker.task_id(order.stage, _sleep_id(hid, order))
            if pairing is not None and isinstance(port, OverlapPort):
                y = pairing.stage
                wake_id = tracker.task_id(f"wake:{y}", f"{hid}-{y}-wake-beside")
                work = sleep_beside_wake(
                    port, order, task_id, policy, pairing=pairing, wake_id=wake_id
                )
            else:
                work = _sleep_or_fence(port, order, task_id, policy)
            tracker.launch(order, _guarded_sleep(order, task_id, work))
        fenced = list(await asyncio.gather(*(_fence(port, order) for order in fences)))
        await tracker.settle(policy.round_wait_s)
        slept = done + tracker.collect()
        tracker.record(slept, fenced)
        for r in slept:
            if r.beside is not None:
                _beside(out, r.beside)
        out.sleeps.extend(slept)
        out.fences.extend(fenced)
        out.fence_pending |= {r.order.stage for r in slept if r.fence_pending}
        out.fence_pending |= {r.order.stage for r in fenced if not r.fenced}
        out.fence_confirmed |= {r.order.stage for r in slept if r.fenced}
        out.fence_confirmed |= {r.order.stage for r in fenced if r.fenced}
        out.sleeps_running, out.handover_began = tracker.running, tracker.began
        handover = tracker.handover()
        obs = _remember(await port.observe(), out)
        decision = _plan(obs, handover, policy, started)
        out.decision, out.observation = decision, obs
        if out.sleeps or out.fences:
            # Started (its status built, its writes sent) before any wake; awaited before the
            # round ends, so a later write of the same status never lands first.
            checkpoint = asyncio.ensure_future(port.checkpoint(out))
            await asyncio.sleep(0)
        tracker.close_if_idle()

    try:
        if decision.wake or decision.component_wakes:
            await _wake_allowed(port, policy, new_id, tracker, decision=decision, out=out)
            obs = _remember(await port.observe(), out)
            decision = _plan(obs, handover, policy, started)
    finally:
        if checkpoint is not None:  # started (its writes issued) before the round returns
            await checkpoint

    out.decision = decision
    out.observation = obs
    return out


async def _wake_allowed(
    port: GroupPort,
    policy: RoundPolicy,
    new_id: Callable[[], str],
    tracker: SleepTracker,
    *,
    decision: Decision,
    out: RoundOutcome,
) -> None:
    """Step 4's wakes of what the arbiter allows; results into ``out``."""
    hid = out.handover_id or new_id()
    out.handover_id = hid
    for name in decision.component_wakes + decision.wake:
        if name in tracker.running:
            continue  # its own sleep's ACK is not in yet: never woken on a guess
        parts = name in decision.component_wakes  # an Active stage's footprint grows
        task_id = f"{hid}-{name}-wake{'-parts' if parts else ''}"
        if tracker.handover_id == hid:  # a hand-over open across rounds: a fresh id
            task_id = tracker.task_id(f"wake:{name}", task_id)
        try:
            result = await _wake(port, name, task_id, policy)
        except Exception as exc:  # isolated per stage
            out.stage_errors[name] = _failure(name, "wake", exc)
            continue
        _woken(out, name, result, parts=parts)


def _woken(out: RoundOutcome, name: str, result: AckFacts | Refusal | str, *, parts: bool) -> None:
    """One wake's result into ``out`` (a refusal for lack of memory, or a wake out of memory,
    teaches the stage's need)."""
    need: int | None = None
    if isinstance(result, str):
        out.wake_errors[name] = result
    elif isinstance(result, Refusal):
        out.wake_refusals[name] = result
        out.wake_errors[name] = f"refused ({result.code}): {result.message}"
        need = result.need_bytes
    else:
        out.wakes[name] = result
        if not result.ok:
            out.wake_errors[name] = result.error or "wake ACK not ok"
            need = memory_need(result.error)
            if result.needed_bytes > 0:
                out.wake_oom[name] = result
                need = max(need or 0, oom_need(result))
    if parts:
        out.component_wakes.add(name)
    elif need is not None:
        out.learned_needs[name] = need


def _beside(out: RoundOutcome, beside: WakeBeside) -> None:
    """The wake an overlapped sleep carried, into ``out``; a worker that cannot wake under a
    limit (its refusal names ``claim_limit_bytes``) is left asleep for step 4's plain wake."""
    result = beside.result
    if isinstance(result, Refusal) and result.message.startswith("claim_limit_bytes"):
        log.info("%s cannot wake under a claim limit (%s): woken the serial way", beside.stage,
                 result.message)  # fmt: skip
        return
    _woken(out, beside.stage, result, parts=False)
